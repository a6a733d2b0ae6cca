"""Process helpers for the tests that kill jobs with real signals."""

from __future__ import annotations

import os
import time
from typing import Callable


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is still running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def group_members(pgid: int) -> list[int]:
    """The pids of process group `pgid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    out.append(int(entry))
            except ProcessLookupError:
                pass
    return out


def wait_for(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    """Poll `pred` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
