"""A memo of accountant results on disk, shared by the jobs of one pipeline.

The same epsilon is asked for many times in a run of the pipeline: the plan
certifies sigma at the fine discretization, then every learning-rate run's
ledger recomputes its epsilon from the event that ran, and learning-rate
selection recomputes the composed epsilon of the cell's runs. For ELS these
are mixture-of-Gaussians PLDs of several seconds each, the same numbers in
every run of a cell. `lookup` / `store` keep each result in one small JSON
file named by the SHA-256 of its key; the key is the full description of
the computation: the accountant's name, the flattened event, delta, the
discretization, the dp-accounting version and the SHA-256 of the
accounting code's source files. A changed event, library or code is a
different key; a file whose stored key differs from the expected one, or
that cannot be read, is ignored (the result is recomputed and rewritten).

The memo is on only where `USERDP_ACCOUNTING_MEMO` names a folder (the
Snakefile sets it to `layout.ACCOUNTING_MEMO`); tests and the command line
compute every epsilon afresh unless they set it. Deleting the folder is
always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from functools import lru_cache
from pathlib import Path

from ..code_version import sources_digest
from ..io import write_json

log = logging.getLogger(__name__)

#: Environment variable naming the memo folder (unset or empty: no memo).
ENV = "USERDP_ACCOUNTING_MEMO"

#: Source files whose code determines an accountant's numbers (their hash is part of every key): the memoized
#: accountant (accounting.py) and every module of this package it imports (tests/test_privacy_memo.py checks).
_SOURCES = ("accounting.py", "pld_arrays.py", "_dp_accounting_compat.py", "rdp.py", "memo.py")


@lru_cache(maxsize=1)
def _code_version() -> str:
    here = Path(__file__).parent
    return sources_digest([here / name for name in _SOURCES], packages=("dp-accounting",))


def folder() -> Path | None:
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def key(accountant: str, *parts) -> str:
    """The key of one computation: the accountant's name, its inputs (by repr) and the code version."""
    return json.dumps([accountant, [repr(p) for p in parts], _code_version()])


def _path(root: Path, k: str) -> Path:
    return root / f"{hashlib.sha256(k.encode()).hexdigest()}.json"


def lookup(k: str) -> float | None:
    """The stored result of key `k`, or None (no memo, no entry, or an entry that does not match)."""
    root = folder()
    if root is None:
        return None
    path = _path(root, k)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("key") != k:
            return None
        value = rec["value"]
        return math.inf if value == "inf" else float(value)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("accounting memo %s unreadable (%s); recomputing", path, exc)
        return None


def store(k: str, value: float) -> None:
    """Record `value` for key `k` (atomically, `io.write_json`; a failure to write is logged and ignored)."""
    root = folder()
    if root is None:
        return
    path = _path(root, k)
    try:
        write_json(path, {"key": k, "value": float(value)})  # inf is written as "inf"
    except OSError as exc:
        log.debug("accounting memo %s not written (%s)", path, exc)
