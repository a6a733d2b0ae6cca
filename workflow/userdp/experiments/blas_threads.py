"""Cap the threads of numpy's OpenBLAS at run time.

The mean-estimation loop does thousands of small matrix products per second.
OpenBLAS splits each one over all cores; on a shared machine (or next to
other Snakemake jobs) the threads wait on each other and the run becomes
tens of times slower than on one thread. OPENBLAS_NUM_THREADS only works
before numpy is imported, so this finds the loaded OpenBLAS and calls its
set_num_threads (what threadpoolctl does, without the dependency). It is
best effort: with another BLAS, nothing happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Iterator

import numpy  # noqa: F401  (loads the BLAS this module looks for)

log = logging.getLogger(__name__)

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


def _openblas() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _symbol(lib: ctypes.CDLL, names: tuple[str, ...]):
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    return None


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[bool]:
    """Run the block with OpenBLAS capped at `n` threads; yields whether the cap applied."""
    lib = _openblas()
    setter = _symbol(lib, _SETTERS) if lib is not None else None
    getter = _symbol(lib, _GETTERS) if lib is not None else None
    if setter is None or getter is None:
        yield False
        return
    previous = int(getter())
    setter(int(n))
    try:
        yield True
    finally:
        setter(previous)
