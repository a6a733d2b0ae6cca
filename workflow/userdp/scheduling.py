"""One re-evaluation timer at a time in Snakemake's job scheduler (a run's own CPU time).

Snakemake 9 (`snakemake.scheduling.job_scheduler.JobScheduler`) keeps a job
rate limiter in every real run (`--max-jobs-per-timespan`, default 100/1s).
With it, every scheduling round that finds ready jobs starts a
`threading.Timer` that wakes the scheduler again one timespan later
(`_schedule_reevalutation`), and that round starts the next timer. Each job
that finishes wakes the scheduler too, so each finished job starts one more
such chain while jobs wait for cores: in the default pipeline on 2 cores
(94 jobs, about 5 minutes) the scheduler ran 10,805 rounds instead of a few
hundred, each computing the input sizes of every ready job: 13.6 of the
snakemake process's 22.4 CPU seconds, taken from the jobs' two cores
(docs/performance.md, "Scheduler rounds"). Snakemake's own pull request
#3744 discusses the wake-ups.

`coalesce_reevaluations` keeps at most one timer pending: a round that asks
for a re-evaluation while one is pending is woken by that one (no later than
it asked for), and the round that timer wakes may start the next. The rate
limit itself is untouched (every round still asks the limiter how many jobs
it may start). The timer is a daemon thread, so the process does not wait
for a pending one at exit.
"""

from __future__ import annotations

import threading

#: The scheduler method that starts a re-evaluation timer (snakemake 9.27.1 spells it so).
METHOD = "_schedule_reevalutation"


class CoalescedReevaluation:
    """A stand-in for the scheduler's `_schedule_reevalutation(delay)`: one pending timer at most."""

    def __init__(self, wake: threading.Semaphore):
        self._wake = wake
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.requested = 0  # calls (rounds that asked for a re-evaluation)
        self.started = 0  # timers started

    def __call__(self, delay: float) -> None:
        with self._lock:
            self.requested += 1
            if self._timer is not None:
                return
            self._timer = threading.Timer(delay, self._fire)
            self._timer.daemon = True
            self.started += 1
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
        self._wake.release()


def coalesce_reevaluations(scheduler) -> CoalescedReevaluation | None:
    """Replace `scheduler`'s re-evaluation timers by one `CoalescedReevaluation`; None if this is not the
    scheduler it was written for (no such method, or no `_open_jobs` semaphore): then nothing changes."""
    wake = getattr(scheduler, "_open_jobs", None)
    if not callable(getattr(type(scheduler), METHOD, None)) or not callable(getattr(wake, "release", None)):
        return None
    current = scheduler.__dict__.get(METHOD)
    if isinstance(current, CoalescedReevaluation):
        return current
    coalesced = CoalescedReevaluation(wake)
    setattr(scheduler, METHOD, coalesced)
    return coalesced
