"""`python -m userdp run`: snakemake's arguments as given, config files checked first and a target that
snakemake would read as a --configfile/--config value refused with how to write it (userdp.snakemake_args,
userdp.cli)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from userdp import snakemake_args
from userdp.cli import main
from userdp.errors import UserError
from userdp.snakemake_args import is_config_file, parse, swallowed_targets

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "configs" / "tiny.yaml"
TARGET = "results/data/tiny/contributions.json"


@pytest.mark.parametrize("args, swallowed", [
    (["-n", "--configfile", "a.yaml", "b.yaml", "target"], ["target"]),
    (["--configfiles", "a.yml", "b.json", "audit", "--cores", "2"], ["audit"]),
    # a .json file in the workflow's output folders is a target, not a config file
    (["--configfile", "mine.yaml", "results/data/mine/contributions.json"], ["results/data/mine/contributions.json"]),
    (["--configfile", "mine.yaml", "./data/mine/download.json"], ["data/mine/download.json"]),
    (["--config", "seed=1", "audit", "-n"], ["audit"]),
    (["-C", "seed=1", "x"], ["x"]),
    # what snakemake reads as meant
    (["--configfile=a.yaml", "audit"], []),
    (["audit", "--configfile", "a.yaml", "b.yaml"], []),
    (["--configfile", "myconf"], []),  # the first value is the option's file, whatever its name
    (["--config", "seed=1", "--cores", "2", "audit"], []),
    ([], []),
])
def test_targets_that_snakemake_would_swallow(args, swallowed):
    call = parse(args)
    if not swallowed:
        swallowed_targets(call)
        return
    with pytest.raises(UserError) as exc:
        swallowed_targets(call)
    msg = str(exc.value)
    assert str(swallowed) in msg and "put the targets first" in msg and "--configfile=" in msg


def test_config_files_and_targets():
    assert is_config_file("my.yaml") and is_config_file("conf/x.YML") and is_config_file("/abs/x.json")
    assert is_config_file("results.json")  # a file, not the results/ folder
    assert not is_config_file("results/findings/default.json") and not is_config_file("data/so/download.json")
    assert not is_config_file("audit") and not is_config_file("results/report.html")


def test_a_missing_config_file_stops_before_snakemake(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(snakemake_args, "run_snakemake", lambda argv: pytest.fail(f"snakemake started: {argv}"))
    missing = tmp_path / "nope.yaml"
    assert main(["run", "audit", "-n", "--configfile", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("userdp run: error:") and f"config file {missing} does not exist" in err
    assert "Traceback" not in err


def test_config_mistakes_are_named_and_stop_before_snakemake(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(snakemake_args, "run_snakemake", lambda argv: pytest.fail(f"snakemake started: {argv}"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid:\n  seeds: [0\n")
    assert main(["run", TARGET, "--configfile", str(bad)]) == 2
    assert f"config file {bad} is not valid YAML at line 3" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("grid:\n  seeds: [0, 1]\n")
    # alone (--replace-workflow-config) it lacks the datasets
    assert main(["run", TARGET, "--replace-workflow-config", "--configfile", str(good)]) == 2
    assert "datasets" in capsys.readouterr().err
    # --config entries are merged last, as snakemake does
    assert main(["run", TARGET, "--configfile", str(good), "--config", "seed=-1"]) == 2
    assert "'seed'" in capsys.readouterr().err


def test_snakemake_gets_the_arguments_as_given_and_its_status_is_returned(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(snakemake_args, "run_snakemake", lambda argv: calls.append(argv) or 3)
    good = tmp_path / "good.yaml"
    good.write_text("grid:\n  seeds: [0, 1]\n")
    assert main(["run", TARGET, "-n", "--configfile", str(good)]) == 3
    assert main(["run", "-n", f"--configfile={good}", TARGET]) == 3
    assert calls == [[TARGET, "-n", "--configfile", str(good)], ["-n", f"--configfile={good}", TARGET]]
    # snakemake's own help needs no config check
    assert main(["run", "--help", "--configfile", str(tmp_path / "nope.yaml")]) == 3
    # a target after the config file stops before snakemake, saying how to write it
    assert main(["run", "-n", "--configfile", str(good), TARGET]) == 2
    err = capsys.readouterr().err
    assert err.startswith("userdp run: error:") and f"['{TARGET}'] follow --configfile" in err
    assert f"--configfile={good} {TARGET}" in err and len(calls) == 3
    # an unknown option: snakemake's parser says so
    assert main(["run", "--no-such-option"]) == 2


def test_run_help_is_ours(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--help"])
    assert exc.value.code == 0
    assert "--configfile=FILE" in " ".join(capsys.readouterr().out.split())


@pytest.mark.integration
def test_dry_run_with_configfile_equals_where_the_plain_order_fails(tmp_path):
    """The order a new user writes: snakemake reads the target as a config file; `--configfile=FILE` ends the
    option, and `userdp run` refuses the plain order with that hint instead of a traceback."""
    base = ["-n", "-s", str(REPO / "Snakefile"), "--replace-workflow-config"]
    plain = subprocess.run([sys.executable, "-m", "snakemake", *base, "--configfile", str(TINY), TARGET], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0 and "FileNotFoundError" in plain.stderr + plain.stdout
    ours = subprocess.run([sys.executable, "-m", "userdp", "run", *base, "--configfile", str(TINY), TARGET],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ours.returncode == 2 and f"--configfile={TINY} {TARGET}" in ours.stderr and "Traceback" not in ours.stderr
    fixed = subprocess.run([sys.executable, "-m", "userdp", "run", *base, f"--configfile={TINY}", TARGET],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0, out[-3000:]
    assert "prepare_data" in out and "This was a dry-run" in out
    assert not (tmp_path / "results").exists()  # a dry run, in the working directory it was started in


@pytest.mark.integration
def test_snakemake_is_started_with_this_python_and_its_status_returned(capfd):
    import snakemake

    assert snakemake_args.run_snakemake(["--version"]) == 0
    assert capfd.readouterr().out.strip() == snakemake.__version__
