"""Atomic artifact writing and small readers.

Every stage writes through these helpers: the content goes to a temporary
file next to the target and is renamed into place only when complete, so a
killed job never leaves a half-written file that looks finished.

Temporary names carry the host and process id (`.{name}.{host}-{pid}.*`):
a job killed with SIGKILL (no cleanup runs) leaves its temporary file behind,
and the next write of the same target removes every such leftover whose
process is gone (`remove_stale_temps`), so reruns never pile up hidden
gigabytes. Leftovers of live processes or other hosts are left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import DataError

log = logging.getLogger(__name__)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def flat_lists(col: pa.Array | pa.ChunkedArray, dtype: type = np.int32) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, [rows + 1] int64 offsets) of a list column."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return values, offsets


def _host_token() -> str:
    """This host's name, and its PID namespace where there is one (containers sharing a hostname and a folder
    each see the other's pids as dead), as it appears in temporary names: no dots, the fields' separator."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
    try:
        return f"{host}_{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return host


_HOST = _host_token()


def temp_prefix(path: str | os.PathLike) -> str:
    """The prefix of this process's temporary files and folders for `path`: `.{name}.{host}-{pid}.`."""
    return f".{Path(path).name}.{_HOST}-{os.getpid()}."


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files and folders of `path` left by dead processes of this host; return them."""
    path = Path(path)
    lead = f".{path.name}.{_HOST}-"
    removed: list[Path] = []
    try:
        entries = [e for e in path.parent.iterdir() if e.name.startswith(lead)]
    except FileNotFoundError:
        return removed
    for entry in entries:
        pid = entry.name[len(lead):].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        removed.append(entry)
        log.info("removed %s, left by a killed process (pid %s)", entry, pid)
    return removed


def _umask() -> int:
    """The process's umask (reading it means setting it: set it back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, chmod_files: bool = True) -> Iterator[Path]:
    """Yield a temporary folder next to `path`; on success it replaces `path` (an old folder there is removed).

    On an exception the temporary folder is removed and `path` is untouched. The folder (and with
    `chmod_files` every file and subfolder in it) gets the permissions the umask allows: mkdtemp makes 0700,
    and some writers 0600 files, so group members could not read the artifact otherwise.
    """
    path = Path(path)
    tmp = make_temp_dir(path)
    try:
        yield tmp
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)
        if chmod_files:
            for f in tmp.rglob("*"):
                os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_temp_dir(path: str | os.PathLike) -> Path:
    """A new temporary folder next to `path` (for folder artifacts), after removing stale ones."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    return Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it to `path` on success.

    On an exception the temporary file is removed and `path` is untouched.
    mode: the file's permissions (e.g. 0o600 for a secret), whatever the
    umask; default what the umask allows (0o666 & ~umask). The temporary
    file is 0600 while it is written either way (mkstemp).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(
        prefix=temp_prefix(path), suffix=suffix if suffix is not None else ".tmp", dir=path.parent
    )
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp creates 0600; give the artifact `mode` or the permissions the umask allows.
        if mode is None:
            mode = 0o666 & ~_umask()
        if tmp_path.is_file():
            os.chmod(tmp_path, mode)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays, paths
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def clean_floats(obj: Any) -> Any:
    """Replace non-finite floats by strings so the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {k: clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_floats(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    """Indented standard JSON of `obj` (numpy values converted, infinities as "inf")."""
    return json.dumps(clean_floats(json.loads(json.dumps(obj, default=_json_default))), indent=2)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically. Infinite floats become "inf"."""
    write_text(path, json_text(obj) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """A pipeline JSON artifact; a missing, truncated or non-JSON file is a DataError naming it and the fix."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; rerun snakemake to build it (the rule that writes it "
                        "runs first).") from None
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DataError(f"{path} is not a readable JSON file ({str(exc)[:200]}): it was truncated or "
                        "overwritten. It is a pipeline artifact: delete it and rerun snakemake, which rebuilds "
                        "it with the rule that writes it (and whatever depends on it).") from None


def write_parquet(path: str | os.PathLike, table: pa.Table | Any) -> None:
    """Write a pyarrow Table (or a pandas DataFrame) to Parquet, atomically."""
    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


@contextlib.contextmanager
def parquet_errors(path: str | os.PathLike) -> Iterator[None]:
    """Turn pyarrow's errors on an unreadable artifact (truncated, not Parquet) into a DataError naming it.

    For the pipeline's own Parquet artifacts: the fix is to rebuild the file. (User data files are read by
    their loaders, which say what is wrong with the file and how to fix it.)
    """
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; rerun snakemake to build it (the rule that writes it "
                        "runs first).") from None
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        missing = re.findall(r"No match for FieldRef\.Name\(([^)]*)\)", str(exc))
        if missing:
            raise DataError(f"{path} has no column {', '.join(missing)}: it was written by another version of userdp "
                            "or another tool. It is a pipeline artifact: delete it and rerun snakemake, which "
                            "rebuilds it with the rule that writes it.") from None
        raise DataError(f"{path} is not a readable Parquet file ({reason}): it was truncated or overwritten. It is "
                        "a pipeline artifact: delete it and rerun snakemake, which rebuilds it with the rule that "
                        "writes it (and whatever depends on it).") from None


def streaming_parquet(path: str | os.PathLike, artifact: bool = True) -> pq.ParquetFile:
    """A ParquetFile to read in batches (`iter_batches`) with memory bounded by one batch.

    pyarrow's default `pre_buffer=True` fetches the requested columns of every
    row group ahead of the batches (meant for high-latency object stores):
    the peak then grows with the file (measured: 169 MB for 2M rows, 394 MB
    for 8M rows of one list column) instead of staying at one row group's
    worth (98 MB for both). Local files gain nothing from it. An unreadable
    artifact is a DataError naming it (`parquet_errors`); artifact=False (a
    user's data file) leaves pyarrow's error to the loader, which explains it.
    """
    with parquet_errors(path) if artifact else contextlib.nullcontext():
        return pq.ParquetFile(path, pre_buffer=False)


def read_table(path: str | os.PathLike, **kwargs: Any) -> pa.Table:
    """pq.read_table of a pipeline artifact; an unreadable file is a DataError naming it."""
    with parquet_errors(path):
        return pq.read_table(path, **kwargs)


def read_frame(path: str | os.PathLike, **kwargs: Any) -> Any:
    """pandas.read_parquet of a pipeline artifact; an unreadable file is a DataError naming it."""
    import pandas as pd

    with parquet_errors(path):
        return pd.read_parquet(path, **kwargs)


def read_schema(path: str | os.PathLike) -> pa.Schema:
    """The Arrow schema of a pipeline artifact's Parquet file; an unreadable file is a DataError naming it."""
    with parquet_errors(path):
        return pq.read_schema(path)


class ParquetBatchWriter:
    """Stream record batches into one Parquet file, renamed into place on close.

    Use as a context manager; on an exception nothing is left at `path`.
    """

    def __init__(self, path: str | os.PathLike, schema: pa.Schema):
        self.path = Path(path)
        self.schema = schema
        self._ctx = atomic_path(self.path)
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def __enter__(self) -> "ParquetBatchWriter":
        tmp = self._ctx.__enter__()
        self._writer = pq.ParquetWriter(tmp, self.schema)
        return self

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        assert self._writer is not None
        if isinstance(batch, pa.RecordBatch):
            batch = pa.Table.from_batches([batch])
        self._writer.write_table(batch.cast(self.schema))
        self.rows += batch.num_rows

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self._writer is not None
        self._writer.close()
        return bool(self._ctx.__exit__(exc_type, exc, tb))


# ---------------------------------------------------------------- canonical params (rule params, JSON)


def sorted_dict(value: Any) -> Any:
    """A copy of `value` with every mapping's keys in sorted order (recursively).

    For rule params built from the config: Snakemake records a param as its
    repr, so the record must depend on content only (see sort_keys_in_place).
    """
    if isinstance(value, Mapping):
        return {str(k): sorted_dict(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [sorted_dict(v) for v in value]
    return value


def sort_keys_in_place(obj: Any) -> None:
    """Sort the keys of every mapping in `obj`, recursively, keeping each dict object.

    Snakemake compares rule params by their repr, so without this a config
    whose keys merely come in another order (a reordered file, defaults filled
    in another order) would rerun every job. Each dict is rebuilt in place
    (clear + update) because Snakemake's `config` must stay the same object;
    lists keep their order (it means something: e.g. the first budget).
    """
    if isinstance(obj, dict):
        for value in obj.values():
            sort_keys_in_place(value)
        items = sorted(obj.items(), key=lambda kv: str(kv[0]))
        obj.clear()
        obj.update(items)
    elif isinstance(obj, list):
        for value in obj:
            sort_keys_in_place(value)
