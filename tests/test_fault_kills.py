"""Hard kills of snakemake itself, in a real run: no finished training is ever redone.

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
from test_train_integration import build_inputs, snakemake
from userdp.layout import fmt_num, iter_cells

pytestmark = pytest.mark.integration


def test_kill_9_of_snakemake_during_finetune_does_not_retrain(tmp_path):
    cfg = build_inputs(tmp_path)
    cell = next(c for c in iter_cells(cfg) if c.method == "els")
    run = tmp_path / cell.run_dir / f"lr~{fmt_num(0.001)}"
    target = str((run / "ledger.json").relative_to(tmp_path))
    job_log = tmp_path / f"results/logs/finetune/tiny/method~els/eps~8/budget~24/seed~0/lr~{fmt_num(0.001)}.log"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(tmp_path / "Snakefile"), "--directory", str(tmp_path),
           target, "--configfile", str(tmp_path / "extra.yaml"), "--cores", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        wait_for(lambda: job_log.exists() or proc.poll() is not None, 300, "the fine-tuning job to start")
        assert proc.poll() is None, "snakemake ended before the fine-tuning job started"
        os.kill(proc.pid, signal.SIGKILL)  # snakemake only; its job keeps running
        proc.wait(timeout=30)
        wait_for(lambda: not group_alive(proc.pid), 300, "the orphaned fine-tuning job to finish")
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "run complete: 3 steps" in job_log.read_text(), "the job did not finish on its own"
    before = (run / "ledger.json").read_bytes(), (run / "model/model.safetensors").read_bytes()

    assert snakemake(tmp_path, "--unlock").returncode == 0
    res = snakemake(tmp_path, target, "--rerun-incomplete")
    assert res.returncode == 0, res.stderr[-4000:]
    text = job_log.read_text()
    assert "restored the finished outputs" in text and text.count("run complete: 3 steps") == 1  # the first attempt's, kept
    assert ((run / "ledger.json").read_bytes(), (run / "model/model.safetensors").read_bytes()) == before
    again = snakemake(tmp_path, target, "--dry-run")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
