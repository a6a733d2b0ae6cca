"""User-facing errors and the wrapper that turns them into clean exits.

A `UserError` is a mistake in the user's input (config, data files,
arguments). It carries a message that names the file or key, says what is
wrong and how to fix it. Scripts run their work through `run_main`, which
prints such errors without a traceback and exits non-zero; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Callable


class UserError(Exception):
    """An error in the user's input, with a message that says how to fix it."""


class ConfigError(UserError):
    """A config key has a wrong value; the message names the key."""


class DataError(UserError):
    """A data file is missing, malformed or empty; the message names the file."""


class PrivacyError(UserError):
    """A privacy target cannot be met (e.g. no noise level reaches epsilon)."""


class AccountingLimitError(PrivacyError):
    """An accountant call would exceed its documented memory bound (the PLD would be too large); refused up front."""


class Preempted(BaseException):
    """Work stopped by SIGTERM (SLURM's preemption and time-limit signal, snakemake's stop). The library raises
    it (training: after saving its checkpoint); the job's entry (`run_main`) exits with 128 + SIGTERM, so SLURM
    and snakemake see a stopped job. A BaseException, like KeyboardInterrupt: `except Exception` blocks do not
    swallow it, and `with` blocks unwind (temporary files of atomic writes are removed)."""

    exit_code = 128 + signal.SIGTERM


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise Preempted(f"stopped by signal {signum}")


def run_main(fn: Callable[[], object], log: logging.Logger | None = None) -> None:
    """Run `fn`; on a UserError print the message and exit with status 2.

    SIGTERM (what SLURM and snakemake send to a job they stop) raises
    `Preempted`, so `with` blocks unwind: temporary files of atomic writes are
    removed instead of being left behind (Python's default SIGTERM action
    kills the process without running any cleanup); the job then exits with
    128 + SIGTERM, as it does when the library raises `Preempted` itself.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        fn()
    except Preempted as exc:
        if log is not None:
            log.warning("%s; exiting with %d", exc, Preempted.exit_code)
        sys.exit(Preempted.exit_code)
    except UserError as exc:
        msg = f"error: {exc}"
        if log is not None:
            log.error(msg)
        print(msg, file=sys.stderr)
        sys.exit(2)
