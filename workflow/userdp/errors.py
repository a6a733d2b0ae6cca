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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_main(fn: Callable[[], object], log: logging.Logger | None = None) -> None:
    """Run `fn`; on a UserError print the message and exit with status 2.

    SIGTERM (what SLURM and snakemake send to a job they stop) becomes a
    SystemExit, so `with` blocks unwind: temporary files of atomic writes are
    removed instead of being left behind (Python's default SIGTERM action
    kills the process without running any cleanup).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        fn()
    except UserError as exc:
        msg = f"error: {exc}"
        if log is not None:
            log.error(msg)
        print(msg, file=sys.stderr)
        sys.exit(2)
