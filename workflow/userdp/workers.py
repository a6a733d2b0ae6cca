"""Worker process pools whose workers die with their parent.

A ProcessPoolExecutor's workers wait on a queue whose write end they hold
themselves, so a kill -9 of the parent (no cleanup runs) leaves them blocked
forever, each holding its memory (they are re-parented to PID 1). Every
worker of `process_pool` runs a daemon thread that exits the worker within
`PARENT_POLL_S` of the pool's creator's death (fork, spawn and forkserver).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

from .io import pid_alive

#: How often a worker checks that its parent is alive (seconds).
PARENT_POLL_S = 0.5


def exit_with_parent(creator_pid: int, every_s: float = PARENT_POLL_S) -> None:
    """In a worker: start a daemon thread that ends this process once the process that made the pool
    (`creator_pid`) is gone or this worker's own parent changed (under forkserver the parent is the fork
    server, which exits with the creator)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent and pid_alive(creator_pid):
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="userdp-exit-with-parent", daemon=True).start()


def _init(parent_pid: int, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    exit_with_parent(parent_pid)
    if initializer is not None:
        initializer(*initargs)


def process_pool(max_workers: int, *, mp_context: Any = None, initializer: Callable[..., Any] | None = None,
                 initargs: tuple = ()) -> ProcessPoolExecutor:
    """A ProcessPoolExecutor whose workers exit when this process dies (then run `initializer(*initargs)`)."""
    return ProcessPoolExecutor(max_workers, mp_context=mp_context, initializer=_init,
                               initargs=(os.getpid(), initializer, initargs))
