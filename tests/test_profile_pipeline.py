"""benchmarks/profile_pipeline.py: per-rule sums from a snakemake log and the jobs' benchmark files."""

from __future__ import annotations

import datetime as dt
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest

from userdp import layout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile():
    spec = importlib.util.spec_from_file_location("profile_pipeline", ROOT / "benchmarks" / "profile_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def _job(lines, stamp, rule, jobid, bench=None):
    lines += [f"[{stamp}]", f"rule {rule}:", "    output: x", f"    jobid: {jobid}"]
    if bench:
        lines.append(f"    benchmark: {bench}")


def _write_run(tmp_path: Path, elapsed: str = "0:05:10.5") -> Path:
    bench = {1: "results/benchmarks/pretrain.tsv", 2: "results/benchmarks/data/tokenizer.tsv",
             3: "results/benchmarks/aggregate/a.tsv"}
    lines: list[str] = []
    _job(lines, "Fri Dec  4 14:30:00 2026", "pretrain", 1, bench[1])
    _job(lines, "Fri Dec  4 14:30:01 2026", "train_tokenizer", 2, bench[2])
    lines += ["[Fri Dec  4 14:30:05 2026]", "Finished jobid: 2 (Rule: train_tokenizer)"]
    _job(lines, "Fri Dec  4 14:30:05 2026", "aggregate", 3, bench[3])  # its benchmark file is missing
    lines += ["[Fri Dec  4 14:30:09 2026]", "Finished jobid: 3 (Rule: aggregate)"]
    lines += ["[Fri Dec  4 14:30:30 2026]", "Finished jobid: 1 (Rule: pretrain)"]
    _job(lines, "Fri Dec  4 14:30:31 2026", "all", 0)
    lines += ["[Fri Dec  4 14:30:31 2026]", "Finished jobid: 0 (Rule: all)", f"Elapsed time: {elapsed}"]
    finished = {1: "Fri Dec  4 14:30:30 2026", 2: "Fri Dec  4 14:30:05 2026"}
    for jobid, (wall, cpu) in {1: (29.5, 28.0), 2: (4.2, 7.9)}.items():
        path = tmp_path / bench[jobid]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADER + f"{wall}\t0:00:{int(wall):02d}\t1\t1\t1\t1\t0\t0\t50\t{cpu}\n")
        when = dt.datetime.strptime(finished[jobid], "%a %b %d %H:%M:%S %Y").timestamp()  # written as it ends
        os.utime(path, (when, when))
    log = tmp_path / ".snakemake" / "log" / "2026-12-04T143000.snakemake.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(lines) + "\n")
    return log


def test_per_rule_sums_from_benchmarks_and_log_times(profile, tmp_path):
    run = profile.read_run(_write_run(tmp_path), tmp_path)
    assert run.elapsed_s == pytest.approx(310.5)
    rows = profile.per_rule(run)
    assert list(rows) == ["pretrain", "train_tokenizer", "aggregate"]  # by wall time, rule all left out
    assert rows["pretrain"] == {"jobs": 1, "wall": 29.5, "cpu": 28.0}
    assert rows["train_tokenizer"] == {"jobs": 1, "wall": 4.2, "cpu": 7.9}
    assert rows["aggregate"] == {"jobs": 1, "wall": 4.0, "cpu": 0.0}  # from the log's start and finish


def test_a_benchmark_file_rewritten_by_a_later_run_is_not_read(profile, tmp_path, capsys):
    log = _write_run(tmp_path)
    later = tmp_path / "results/benchmarks/pretrain.tsv"
    os.utime(later, (later.stat().st_mtime + 3600, later.stat().st_mtime + 3600))  # another run's pretrain
    rows = profile.per_rule(profile.read_run(log, tmp_path))
    assert rows["pretrain"] == {"jobs": 1, "wall": 30.0, "cpu": 0.0}  # the log's start and finish
    assert rows["train_tokenizer"] == {"jobs": 1, "wall": 4.2, "cpu": 7.9}  # its file is this run's
    err = capsys.readouterr().err
    assert "1 benchmark file(s)" in err and "pretrain.tsv" in err


def test_ratios_against_a_baseline(profile, tmp_path):
    after = profile.read_run(_write_run(tmp_path / "after", "0:02:35.25"), tmp_path / "after")
    before = profile.read_run(_write_run(tmp_path / "before"), tmp_path / "before")
    out = io.StringIO()
    profile.report(after, before, out=out)
    text = out.getvalue()
    assert "elapsed after/before: 0.50x" in text
    assert " 1.00x  1.00x" in text.splitlines()[-3]  # pretrain, the same files


def test_main_finds_the_newest_log_under_the_root(profile, tmp_path, capsys, monkeypatch):
    _write_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    profile.main([])
    assert "3 jobs, elapsed 310 s" in capsys.readouterr().out


def test_benchmark_paths_mirror_the_logs():
    assert layout.benchmark_of("results/logs/pretrain.log") == "results/benchmarks/pretrain.tsv"
    assert layout.benchmark_of("results/logs/finetune/{dataset}/{cell}.log") == \
        "results/benchmarks/finetune/{dataset}/{cell}.tsv"
    with pytest.raises(ValueError, match="not a log template"):
        layout.benchmark_of("results/other/x.log")


@pytest.mark.integration
def test_cpu_of_command_counts_the_descendants_and_passes_the_exit_status(tmp_path):
    import re
    import subprocess

    # a child that starts a grandchild burning about 0.6 s of CPU, then exits 3
    burn = ("import time; t = time.process_time()\n"
            "while time.process_time() - t < 0.6: pass\n")
    child = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}], check=True); sys.exit(3)")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_of_command.py"), "--", sys.executable, "-c",
                           child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    m = re.search(r"exit status 3; wall ([\d.]+) s; CPU of the command and its descendants ([\d.]+) s", proc.stderr)
    assert m, proc.stderr
    wall, cpu = float(m.group(1)), float(m.group(2))
    assert cpu >= 0.6 and wall > 0 and "machine idle" in proc.stderr
    none = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_of_command.py")], capture_output=True,
                          text=True, timeout=60)
    assert none.returncode == 2 and "give the command to run after --" in none.stderr
