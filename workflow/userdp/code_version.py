"""Digests of the code that produced a result, for keys that must change when the code does.

`sources_digest` hashes chosen source files (and package versions); `package_digest`
hashes every Python file of the userdp package, for results any module can change
(a finished fine-tuning run, see userdp.training.finished).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Iterable

PACKAGE_DIR = Path(__file__).parent


def sources_digest(files: Iterable[Path], packages: Iterable[str] = ()) -> str:
    """SHA-256 over the files' paths (relative to the package) and bytes, and the installed packages' versions."""
    h = hashlib.sha256()
    for path in files:
        path = Path(path)
        h.update(str(path.relative_to(PACKAGE_DIR) if path.is_relative_to(PACKAGE_DIR) else path.name).encode())
        h.update(path.read_bytes())
    for name in packages:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "unknown"
        h.update(f"{name}=={version}".encode())
    return h.hexdigest()


@lru_cache(maxsize=None)
def package_digest(packages: tuple[str, ...] = ()) -> str:
    """sources_digest of every .py file of userdp (sorted), with the given packages' versions."""
    return sources_digest(sorted(PACKAGE_DIR.rglob("*.py")), packages)
