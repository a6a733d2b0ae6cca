"""Stops and hard kills of snakemake itself, in a real run: no finished training is ever redone.

kill -9 of snakemake while a fine-tuning job runs: the job finishes on its own, but snakemake never records
its outputs; after `--unlock`, `--rerun-incomplete` deletes and reruns the job. The job must find its own
finished record (userdp.training.finished) and restore the outputs bit for bit instead of training again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proc_helpers import group_alive, wait_for
from userdp.layout import fmt_num
from userdp.grid import iter_cells

pytestmark = pytest.mark.integration


def _start(root: Path, *targets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "--directory", str(root), *targets,
           "--configfile", str(root / "extra.yaml"), "--cores", "1"]  # one job at a time: the stop lands in one
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_stopping_snakemake_never_redoes_finished_training(train_stage, tmp_path):
    """SIGTERM, then kill -9, of snakemake while a fine-tuning job runs (the two runs of one config).

    SIGTERM (`kill PID`): snakemake starts nothing new, lets the running job finish, records it and exits 1 with
    "At least one job did not complete successfully" (about the jobs never started; docs/operations.md, "After a
    kill").
    kill -9: the orphaned job finishes; after --unlock, --rerun-incomplete restores its outputs from finished/.
    """
    cfg, snakemake = train_stage.config, train_stage.snakemake
    runs, logs = {}, {}
    for cell in iter_cells(cfg):
        runs[cell.method] = tmp_path / cell.run_dir / f"lr~{fmt_num(0.001)}"
        logs[cell.method] = tmp_path / f"results/logs/finetune/tiny/method~{cell.method}/eps~8/budget~24/seed~0.log"
    targets = {m: str((r / "ledger.json").relative_to(tmp_path)) for m, r in runs.items()}

    # SIGTERM during the first fine-tuning job
    proc = _start(tmp_path, *targets.values())
    try:
        wait_for(lambda: any(p.exists() for p in logs.values()) or proc.poll() is not None, 300,
                 "a fine-tuning job to start")
        assert proc.poll() is None, "snakemake ended before a fine-tuning job started"
        first = next(m for m, p in logs.items() if p.exists())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    second = next(m for m in runs if m != first)
    assert proc.returncode == 1 and "At least one job did not complete successfully" in out, out[-3000:]
    assert "run complete: 3 steps" in logs[first].read_text() and (runs[first] / "ledger.json").exists()
    assert not logs[second].exists(), "snakemake started a job after SIGTERM"
    plan = snakemake(*targets.values(), "--dry-run")
    outputs = [line for line in plan.stdout.splitlines() if line.strip().startswith("output:")]
    assert plan.returncode == 0 and len(outputs) == 1, plan.stdout[-3000:]  # only the job never started
    assert targets[second] in outputs[0] and targets[first] not in outputs[0]

    # kill -9 during the second
    proc = _start(tmp_path, targets[second])
    try:
        wait_for(lambda: logs[second].exists() or proc.poll() is not None, 300, "the fine-tuning job to start")
        assert proc.poll() is None, "snakemake ended before the fine-tuning job started"
        os.kill(proc.pid, signal.SIGKILL)  # snakemake only; its job keeps running
        proc.wait(timeout=30)
        wait_for(lambda: not group_alive(proc.pid), 300, "the orphaned fine-tuning job to finish")
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    job_log, run = logs[second], runs[second]
    assert "run complete: 3 steps" in job_log.read_text(), "the job did not finish on its own"
    before = (run / "ledger.json").read_bytes(), (run / "model/model.safetensors").read_bytes()

    assert snakemake("--unlock").returncode == 0
    res = snakemake(targets[second], "--rerun-incomplete")
    assert res.returncode == 0, res.stderr[-4000:]
    text = job_log.read_text()
    assert "restored the finished outputs" in text and text.count("run complete: 3 steps") == 1  # the first attempt's, kept
    assert ((run / "ledger.json").read_bytes(), (run / "model/model.safetensors").read_bytes()) == before
    again = snakemake(*targets.values(), "--dry-run")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
