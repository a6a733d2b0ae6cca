"""One re-evaluation timer at a time in Snakemake's scheduler (userdp.scheduling, called from the workflow's
onstart in workflow/rules/common.smk)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from userdp import scheduling

ROOT = Path(__file__).resolve().parents[1]


def test_requests_while_a_timer_is_pending_share_it():
    wake = threading.Semaphore(0)
    c = scheduling.CoalescedReevaluation(wake)
    for _ in range(5):
        c(0.05)
    assert (c.requested, c.started) == (5, 1)
    assert wake.acquire(timeout=5)
    assert not wake.acquire(timeout=0.2)  # one wake-up for the five requests, not five
    c(0.01)  # after it fired, the next request starts the next timer
    assert c.started == 2
    assert wake.acquire(timeout=5)


def test_the_timer_is_a_daemon_and_wakes_no_earlier_than_asked():
    wake = threading.Semaphore(0)
    c = scheduling.CoalescedReevaluation(wake)
    t0 = time.monotonic()
    c(0.2)
    assert c._timer is not None and c._timer.daemon
    assert wake.acquire(timeout=5)
    assert time.monotonic() - t0 >= 0.19


def test_installed_on_snakemakes_own_scheduler_class():
    """The pinned snakemake has the method and semaphore this replaces (a rename would leave runs unpatched)."""
    from snakemake.scheduling.job_scheduler import JobScheduler

    sched = object.__new__(JobScheduler)  # no run: only the method lookup and the semaphore matter here
    sched._open_jobs = threading.Semaphore(0)
    c = scheduling.coalesce_reevaluations(sched)
    assert isinstance(c, scheduling.CoalescedReevaluation)
    assert scheduling.coalesce_reevaluations(sched) is c  # twice: the same one
    sched._schedule_reevalutation(0.01)
    sched._schedule_reevalutation(0.01)
    assert (c.requested, c.started) == (2, 1)
    assert sched._open_jobs.acquire(timeout=5)


def test_anything_else_is_left_alone():
    assert scheduling.coalesce_reevaluations(None) is None
    assert scheduling.coalesce_reevaluations(object()) is None

    class NoSemaphore:
        def _schedule_reevalutation(self, delay):
            pass

    assert scheduling.coalesce_reevaluations(NoSemaphore()) is None


def test_the_workflow_installs_it_at_start():
    common = (ROOT / "workflow/rules/common.smk").read_text()
    onstart = common.split("onstart:", 1)[1].split("\n\n", 1)[0]
    assert 'scheduling.coalesce_reevaluations(getattr(workflow, "scheduler", None))' in onstart


_SNAKEFILE = """\
import sys
sys.path.insert(0, {package!r})
from userdp import scheduling

onstart:
    if config.get("coalesce"):
        scheduling.coalesce_reevaluations(workflow.scheduler)

rule all:
    input: expand("out/{{i}}.txt", i=range(6))

rule one:
    output: "out/{{i}}.txt"
    shell: "sleep 1; touch {{output}}"
"""


def _rounds(tmp_path: Path, coalesce: bool) -> int:
    work = tmp_path / ("on" if coalesce else "off")
    work.mkdir()
    (work / "Snakefile").write_text(_SNAKEFILE.format(package=str(ROOT / "workflow")))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "--verbose", "--config", f"coalesce={int(coalesce)}"],
        cwd=work, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((work / "out").iterdir())) == 6
    return (proc.stdout + proc.stderr).count("Ready jobs")


@pytest.mark.integration
def test_a_real_run_schedules_far_fewer_rounds(tmp_path):
    """Six 1-second jobs on one core, five waiting at a time: snakemake's own timers multiply (a chain per
    finished job, ~1 + 2 + ... + 6 rounds); coalesced there is about one round per second and per job."""
    off, on = _rounds(tmp_path, False), _rounds(tmp_path, True)
    assert on <= 20, on
    assert off >= 1.5 * on, (off, on)
