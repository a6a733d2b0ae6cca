"""The pipeline through a real SLURM cluster (snakemake-executor-plugin-slurm).

A single-node cluster (munged, slurmctld, slurmd from Debian's slurm-wlm and
munge packages) is brought up by tests/slurm/slurm-up.sh. The tiny config
(tests/slurm/config.yaml) runs through the CPU profile profiles/slurm-cpu and,
at the same time, locally in another folder; then:

- every job except the local download rule went through sbatch (the
  executor's "submitted with SLURM jobid" lines, one per non-local job, and
  SLURM's own job completion log says each of those jobs COMPLETED);
- the artifacts are equal to the local run's: data tables, tokenizer, plans,
  models (byte for byte), training logs and metrics.json (exactly: training
  is seeded and runs with the same thread count on the same CPU). Only
  wall-clock fields (timestamps, `seconds`) differ.

Skips, with the reason, where SLURM is not installed or cannot start (no root,
a foreign slurm.conf, daemons that do not come up). USERDP_REQUIRE_SLURM=1
turns those skips into failures (for CI that installed the packages).
At the end, stops only the daemons this test started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from userdp.config import validate_config
from userdp.grid import iter_cells

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "slurm"
CONFIG = HERE / "config.yaml"
PROFILE = REPO / "profiles" / "slurm-cpu"
STATE = Path(os.environ.get("SLURM_LOCAL_STATE", "/run/slurm-local"))
DAEMONS = ("munged", "slurmctld", "slurmd")
RUN_TIMEOUT_S = 480
# Keys whose values are wall-clock measurements, not results.
TIMING_KEYS = {"seconds", "finished", "started"}


def _unavailable(reason: str):
    if os.environ.get("USERDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM required (USERDP_REQUIRE_SLURM=1) but: {reason}")
    pytest.skip(reason)


def _privileged() -> list[str] | None:
    """Command prefix to run the start/stop scripts as root, or None when impossible."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n", "--preserve-env=SLURM_LOCAL_STATE"]
    return None


def _markers() -> dict[str, str]:
    """Daemon -> pid recorded by slurm-up.sh as started by it."""
    return {d: (STATE / f"{d}.started").read_text().strip() for d in DAEMONS if (STATE / f"{d}.started").exists()}


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node SLURM; stops at the end only what this fixture started."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # the daemons live in sbin
    missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch", "squeue") if shutil.which(c, path=path) is None]
    if missing:
        _unavailable(f"SLURM not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge")
    # find_spec, not import: importing the plugin queries sacct/scontrol, which wait ~10 s while SLURM is down
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        _unavailable("snakemake-executor-plugin-slurm not installed (pip install -e '.[test]')")
    prefix = _privileged()
    if prefix is None:
        _unavailable("starting SLURM needs root (or passwordless sudo) for tests/slurm/slurm-up.sh")
    before = _markers()
    up = subprocess.run([*prefix, str(HERE / "slurm-up.sh")], capture_output=True, text=True, timeout=120)
    started = [d for d, pid in _markers().items() if before.get(d) != pid]
    if up.returncode != 0:
        if started:
            subprocess.run([*prefix, str(HERE / "slurm-down.sh"), *started], capture_output=True, timeout=120)
        _unavailable(f"tests/slurm/slurm-up.sh could not bring SLURM up (rc={up.returncode}): {up.stderr.strip()[-1500:]}")
    yield
    if started:
        down = subprocess.run([*prefix, str(HERE / "slurm-down.sh"), *started], capture_output=True, text=True,
                              timeout=180)
        assert down.returncode == 0, down.stderr


def _targets() -> list[str]:
    """metrics.json of every cell: needs data, plan, pretrain, finetune, evaluate and select_lr."""
    cfg = validate_config(yaml.safe_load(CONFIG.read_text()))
    return [f"{cell.run_dir}/metrics.json" for cell in iter_cells(cfg)]


def _snakemake_cmd(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--directory", str(workdir), "-s", str(REPO / "Snakefile"),
            "--configfile", str(CONFIG), *args, *_targets()]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _job_stats(log: str) -> dict[str, int]:
    """Rule -> job count from the 'Job stats' table."""
    table = log.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


def _submissions(log: str) -> dict[str, list[str]]:
    """Rule -> SLURM job ids, from the executor's log: each 'rule X:' block's jobid, then its submission line."""
    rule_of_job: dict[str, str] = {}
    for m in re.finditer(r"^(local)?rule (\w+):\n(?:    .*\n)*?    jobid: (\d+)$", log, re.M):
        rule_of_job[m.group(3)] = ("local:" if m.group(1) else "") + m.group(2)
    subs: dict[str, list[str]] = {}
    for m in re.finditer(r"^Job (\d+) has been submitted with SLURM jobid (\d+)", log, re.M):
        subs.setdefault(rule_of_job[m.group(1)], []).append(m.group(2))
    return subs


def _local_rules(log: str) -> list[str]:
    return re.findall(r"^localrule (\w+):$", log, re.M)


def _completed_in_slurm(job_ids: list[str]) -> dict[str, str]:
    """SLURM's final state of each job: from the job completion log, else from squeue --states=all."""
    conf = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    loc = re.search(r"^JobCompLoc\s*=\s*(\S+)", conf, re.M)
    states: dict[str, str] = {}
    if "jobcomp/filetxt" in conf and loc and Path(loc.group(1)).exists():
        for m in re.finditer(r"JobId=(\d+) .*?JobState=(\w+)", Path(loc.group(1)).read_text()):
            states[m.group(1)] = m.group(2)
    out = subprocess.run(["squeue", "--states=all", "-h", "-o", "%i %T", "-j", ",".join(job_ids)],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        jid, state = line.split()
        states.setdefault(jid, state)
    return {j: states.get(j, "UNKNOWN") for j in job_ids}


def _strip_timing(obj):
    if isinstance(obj, dict):
        return {k: _strip_timing(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [_strip_timing(v) for v in obj]
    return obj


def _assert_same_artifacts(local: Path, slurm: Path) -> None:
    def compared(root: Path) -> list[Path]:  # logs (results/logs/, a finished run's attempt.log) and the jobs'
        # benchmark files (results/benchmarks/: wall time, memory) hold timings
        return sorted(p.relative_to(root) for p in (root / "results").rglob("*")
                      if p.is_file() and "logs" not in p.parts and "benchmarks" not in p.parts
                      and p.suffix != ".log")

    files = compared(local)
    assert set(compared(slurm)) \
        == set(files)
    kinds = {"plan": 0, "tokens": 0, "metrics": 0, "model": 0}
    for rel in [Path("data/synth/download.json"), *files]:
        a, b = local / rel, slurm / rel
        if rel.suffix == ".json":
            ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
            assert _strip_timing(ja) == _strip_timing(jb), rel
            kinds["plan"] += "plan" in rel.parts
            kinds["metrics"] += rel.name == "metrics.json"
        elif rel.suffix == ".parquet":
            ta, tb = pq.read_table(a), pq.read_table(b)
            keep = [c for c in ta.column_names if c not in TIMING_KEYS]
            assert ta.column_names == tb.column_names, rel
            assert ta.select(keep).equals(tb.select(keep)), rel
            kinds["tokens"] += rel.name == "tokens.parquet"
        else:  # safetensors weights, tokenizer files: byte for byte
            assert a.read_bytes() == b.read_bytes(), rel
            kinds["model"] += rel.suffix == ".safetensors" and "finished" not in rel.parts  # not the records' links
    # the comparison covered every stage
    assert kinds["plan"] == 2 and kinds["metrics"] == 2 and kinds["tokens"] == 1 and kinds["model"] == 3, kinds


def test_tiny_pipeline_through_slurm_equals_local_run(slurm_cluster, tmp_path):
    local_dir, slurm_dir = tmp_path / "local", tmp_path / "slurm"
    local_dir.mkdir()
    slurm_dir.mkdir()
    # The local run shares the CPUs while the SLURM run mostly waits on polling.
    local_log = tmp_path / "local.log"
    with open(local_log, "w") as fh:
        local = subprocess.Popen(_snakemake_cmd(local_dir, "--cores", "1"), stdout=fh, stderr=subprocess.STDOUT,
                                 env=_env())
        try:
            slurm = subprocess.run(_snakemake_cmd(slurm_dir, "--workflow-profile", str(PROFILE), "--jobs", "2"),
                                   capture_output=True, text=True, env=_env(), timeout=RUN_TIMEOUT_S)
        finally:
            local.wait(timeout=RUN_TIMEOUT_S)
    log = slurm.stdout + slurm.stderr
    assert slurm.returncode == 0, log[-6000:]
    assert local.returncode == 0, local_log.read_text()[-4000:]

    # Every job but the download went through sbatch, exactly once.
    stats = _job_stats(log)
    assert {"prepare_data", "plan", "pretrain", "finetune", "select_lr"} <= set(stats), stats
    assert _local_rules(log) == ["download_data"] * stats["download_data"]
    subs = _submissions(log)
    assert {rule: len(ids) for rule, ids in subs.items()} == {r: n for r, n in stats.items() if r != "download_data"}
    job_ids = [j for ids in subs.values() for j in ids]
    assert len(set(job_ids)) == sum(stats.values()) - stats["download_data"]
    assert set(_completed_in_slurm(job_ids).values()) == {"COMPLETED"}, _completed_in_slurm(job_ids)
    # each job ran its rule inside SLURM and left its log (slurm-keep-successful-logs)
    for rule, ids in subs.items():
        for jid in ids:
            (job_log,) = (slurm_dir / ".snakemake/slurm_logs").glob(f"rule_{rule}/**/{jid}.log")
            text = job_log.read_text()
            assert f"rule {rule}:" in text and "1 of 1 steps (100%) done" in text, job_log

    _assert_same_artifacts(local_dir, slurm_dir)
