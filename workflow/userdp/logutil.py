"""Logging for scripts run by Snakemake: to the rule's log file and stderr."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable


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
    """Periodic progress lines with rate and ETA for long loops: the package's one progress helper (data reading,
    tokenizing, pretraining, DP training).

    A line every `every_s` seconds and at the last item (`total`; None: count and rate only); `start`: items
    done before this invocation (a resumed run), shown in the count but not in the rate; `first`: a line at the
    first item too. `extra` (a string, or a function returning one, called only when a line is written) ends
    the line.
    """

    def __init__(self, log: logging.Logger, total: int | None, what: str, every_s: float = 10.0, *,
                 start: int = 0, first: bool = False):
        self.log, self.total, self.what, self.every_s = log, total, what, every_s
        self.start = time.monotonic()
        self.last = self.start - every_s if first else self.start
        self.offset, self.done = int(start), 0

    def update(self, n: int = 1, extra: str | Callable[[], str] = "") -> None:
        self.done += n
        count = self.offset + self.done
        now = time.monotonic()
        if now - self.last >= self.every_s or (self.total is not None and count >= self.total):
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            rate = self.done / elapsed
            tail = extra() if callable(extra) else extra
            if self.total:
                eta = (self.total - count) / rate if rate > 0 else float("inf")
                self.log.info(
                    "%s: %d/%d (%.1f%%), %.1f/s, ETA %.0fs %s",
                    self.what, count, self.total, 100 * count / self.total, rate, eta, tail,
                )
            else:
                self.log.info("%s: %d, %.1f/s %s", self.what, count, rate, tail)
