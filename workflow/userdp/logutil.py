"""Logging for scripts run by Snakemake: to the rule's log file and stderr."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path


def setup_logging(log_path: str | None = None, name: str = "userdp") -> logging.Logger:
    """Configure the root logger to write to `log_path` (if given) and stderr.

    The log is appended to, so a resumed or rerun job keeps the earlier attempts' lines (why the first one
    stopped), each attempt after the first starting with a `===== attempt ...` line.
    """
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        path = Path(log_path)
        if path.exists() and path.stat().st_size > 0:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f"\n===== attempt started {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()}); "
                         "earlier attempts above =====\n")
        handlers.append(logging.FileHandler(log_path, mode="a", encoding="utf-8"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    return logging.getLogger(name)


class Progress:
    """Periodic progress lines with rate and ETA for long loops."""

    def __init__(self, log: logging.Logger, total: int | None, what: str, every_s: float = 10.0):
        self.log, self.total, self.what, self.every_s = log, total, what, every_s
        self.start = self.last = time.monotonic()
        self.done = 0

    def update(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s or (self.total is not None and self.done >= self.total):
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            rate = self.done / elapsed
            if self.total:
                eta = (self.total - self.done) / rate if rate > 0 else float("inf")
                self.log.info(
                    "%s: %d/%d (%.1f%%), %.1f/s, ETA %.0fs %s",
                    self.what, self.done, self.total, 100 * self.done / self.total, rate, eta, extra,
                )
            else:
                self.log.info("%s: %d, %.1f/s %s", self.what, self.done, rate, extra)
