"""Interrupted jobs: SIGTERM (SLURM's and snakemake's stop signal) leaves no temporary files behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

CHILD = r"""
import sys, time
from pathlib import Path
from userdp.errors import run_main
from userdp.io import atomic_path

out = Path(sys.argv[1])

def main():
    with atomic_path(out) as tmp:
        tmp.write_bytes(b"x" * 1000)
        (out.parent / "ready").write_text("1")
        time.sleep(60)

run_main(main)
"""


@pytest.mark.helper_process
@pytest.mark.parametrize("use_run_main", [True, False])
def test_sigterm_during_an_atomic_write_leaves_nothing(tmp_path, use_run_main):
    out = tmp_path / "artifact.parquet"
    code = CHILD if use_run_main else CHILD.replace("run_main(main)", "main()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)])
    deadline = time.time() + 60
    while not (tmp_path / "ready").exists():
        assert time.time() < deadline and proc.poll() is None, "child did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "ready")
    assert not out.exists()
    if use_run_main:
        assert rc == 128 + signal.SIGTERM and leftovers == []
    else:  # Python's default action: killed, cleanup skipped (what run_main prevents)
        assert rc == -signal.SIGTERM and len(leftovers) == 1 and leftovers[0].startswith(".artifact.parquet.")


def test_a_rerun_job_appends_to_its_log_and_marks_the_attempt(tmp_path):
    """The log of a killed, then resumed job keeps the first attempt's lines (why it stopped)."""
    import logging

    from userdp.logutil import setup_logging

    log_path = tmp_path / "job.log"
    setup_logging(str(log_path)).info("first attempt: step 3/10")
    setup_logging(str(log_path)).info("second attempt: resumed at step 3")
    logging.getLogger().handlers.clear()
    text = log_path.read_text()
    assert text.index("first attempt") < text.index("===== attempt started") < text.index("second attempt")
    assert text.count("===== attempt started") == 1  # the first attempt gets no header
