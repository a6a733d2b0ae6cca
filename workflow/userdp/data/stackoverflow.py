"""Stack Overflow, as released by TensorFlow Federated (one SQLite file).

Spec keys (`datasets.<name>.<key>`), defaults in brackets:

- `path` [null]: a local copy, `.sqlite` (read in place) or `.sqlite.lzma`
  (decompressed once into the data dir). With a path, nothing is downloaded.
- `url` [`DEFAULT_URL`]: the lzma-compressed release, downloaded into the data
  dir with resume (HTTP Range) and decompressed streaming.
- `sha256` [null]: expected SHA-256 of the downloaded (or given .lzma) file.
- `splits` [`[train, heldout]`]: which source splits to read. `train` and
  `test` share users (split by date), `heldout` users are disjoint from both;
  the default leaves out `test` so that no user's later posts sneak into an
  evaluation set. Each row keeps its split in `source_split`, so the split
  stage can put the heldout users into validation/test
  (`split.use_source_split`).
- `include_title` [false]: prepend the post's title to the text. Off by
  default: a row is one sentence of a post, so the title would be repeated on
  every sentence of the post.
- `max_examples` [null]: stop after this many rows (in file order).

Rows are read in keyset pages over `rowid` (`WHERE rowid > last ORDER BY
rowid LIMIT n`), so memory is one page whatever the table size, and each
page costs an index seek rather than an OFFSET scan.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from ..errors import ConfigError, DataError
from ..io import sha256_file
from ..logutil import Progress
from . import download as dl
from .base import RAW_SCHEMA, NoPublicPart
from .sources import source_keys
from .spec_keys import check_keys, max_examples
from .tfexample import DecodeError, bytes_feature, example_class

log = logging.getLogger(__name__)

DEFAULT_URL = "https://storage.googleapis.com/tff-datasets-public/stackoverflow.sqlite.lzma"
SPLITS = ("train", "heldout", "test")
DEFAULT_SPLITS = ("train", "heldout")

_EXAMPLE_COLUMNS = {"split_name", "client_id", "serialized_example_proto"}
_METADATA_COLUMNS = {"client_id", "split_name", "num_examples"}


def _connect_ro(path: Path) -> sqlite3.Connection:
    # Read-only: never create a journal next to a (possibly shared) release file.
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)


def check_tff_sqlite(path: Path) -> None:
    """Raise DataError unless `path` is a SQLite file with the TFF tables and columns."""
    if not path.is_file():
        raise DataError(f"{path} does not exist; check datasets.<name>.path or rerun the download.")
    try:
        with contextlib.closing(_connect_ro(path)) as con:
            tables = {
                name: {row[1] for row in con.execute(f"PRAGMA table_info({name})")}
                for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
    except sqlite3.DatabaseError as exc:
        raise DataError(
            f"{path} is not a readable SQLite database ({exc}); expected the TFF Stack Overflow "
            "release (stackoverflow.sqlite). Delete it to download it again, or fix datasets.<name>.path."
        ) from exc
    for table, need in (("examples", _EXAMPLE_COLUMNS), ("client_metadata", _METADATA_COLUMNS)):
        if table not in tables:
            raise DataError(
                f"{path} has no table '{table}' (tables: {sorted(tables)}); expected the TFF Stack "
                "Overflow schema: examples(split_name, client_id, serialized_example_proto) and "
                "client_metadata(client_id, split_name, num_examples)."
            )
        missing = need - tables[table]
        if missing:
            raise DataError(
                f"{path}: table '{table}' lacks column(s) {sorted(missing)} (has {sorted(tables[table])}); "
                "expected the TFF Stack Overflow schema."
            )


class StackOverflowSource(NoPublicPart):
    """The TFF Stack Overflow SQLite, streamed in pages of rows."""

    def __init__(self, name: str, spec: dict, data_dir: Path, seed: int = 0):
        check_keys(name, spec, source_keys("stackoverflow"))
        self.name, self.spec, self.data_dir, self.seed = name, spec, Path(data_dir), seed
        self.path = Path(spec["path"]).expanduser() if spec.get("path") else None
        self.url = spec.get("url") or DEFAULT_URL
        self.sha256 = spec.get("sha256")
        self.include_title = bool(spec.get("include_title", False))
        self.max_examples = max_examples(name, spec)
        splits = spec.get("splits", list(DEFAULT_SPLITS))
        if not isinstance(splits, (list, tuple)) or not splits or any(s not in SPLITS for s in splits):
            raise ConfigError(
                f"datasets.{name}.splits is {splits!r}; it must be a non-empty list drawn from {list(SPLITS)}."
            )
        self.splits = list(dict.fromkeys(splits))

    # ---------------------------------------------------------------- files

    def sqlite_path(self) -> Path:
        """Where the decompressed SQLite is (or will be)."""
        if self.path is not None and self.path.suffix != ".lzma":
            return self.path
        compressed = self.path if self.path is not None else self.data_dir / Path(self.url).name
        stem = compressed.name[: -len(".lzma")] if compressed.name.endswith(".lzma") else compressed.name
        if not stem.endswith(".sqlite"):
            stem += ".sqlite"
        return self.data_dir / stem

    def download(self) -> None:
        """Fetch (unless `path` is given) and decompress the release; a no-op when done."""
        target = self.sqlite_path()
        if self.path is not None and self.path.suffix != ".lzma":
            check_tff_sqlite(self.path)
            return
        if target.exists():
            return
        if self.path is not None:
            if not self.path.is_file():
                raise DataError(f"{self.path} (datasets.{self.name}.path) does not exist.")
            compressed = self.path
            if self.sha256 and sha256_file(compressed) != self.sha256.lower():
                raise DataError(
                    f"{compressed}: SHA-256 does not match datasets.{self.name}.sha256 ({self.sha256})."
                )
        else:
            compressed = dl.download(self.url, self.data_dir / Path(self.url).name, self.sha256)
        dl.decompress_lzma(compressed, target)
        try:
            check_tff_sqlite(target)
        except DataError:
            target.unlink()  # do not leave a file that looks like a finished decompression
            raise

    # ---------------------------------------------------------------- rows

    def _decode(self, path: Path, rows: list[tuple]) -> pa.RecordBatch:
        Example = example_class()
        users, texts, splits = [], [], []
        for rowid, split, client, blob in rows:
            try:
                ex = Example.FromString(blob)
            except (DecodeError, TypeError) as exc:
                raise DataError(
                    f"{path}: examples rowid {rowid} holds no valid tf.train.Example ({exc}); "
                    "the file is corrupt: delete it and download it again."
                ) from exc
            tokens = bytes_feature(ex, "tokens")
            if tokens is None:
                raise DataError(
                    f"{path}: examples rowid {rowid} has no 'tokens' feature "
                    f"(has {sorted(ex.features.feature)}); expected the TFF Stack Overflow format."
                )
            text = tokens.decode("utf-8", errors="replace")
            if self.include_title:
                title = bytes_feature(ex, "title")
                if title:
                    text = title.decode("utf-8", errors="replace") + " " + text
            users.append(client)
            texts.append(text)
            splits.append(split)
        return pa.RecordBatch.from_arrays(
            [pa.array(users, pa.string()), pa.array(texts, pa.string()), pa.array(splits, pa.string())],
            schema=RAW_SCHEMA,
        )

    def _expected_rows(self, con: sqlite3.Connection) -> int | None:
        marks = ",".join("?" * len(self.splits))
        total = con.execute(
            f"SELECT SUM(num_examples) FROM client_metadata WHERE split_name IN ({marks})", self.splits
        ).fetchone()[0]
        if self.max_examples is not None:
            total = min(total or 0, self.max_examples)
        return int(total) if total else None

    def expected_rows(self) -> int | None:
        """Rows `iter_batches` will yield, from `client_metadata` (None if unknown).

        Lets the prepare stage log an ETA; costs one small query, no scan.
        Returns None when the file is not there yet or cannot be read.
        """
        path = self.sqlite_path()
        if not path.is_file():
            return None
        try:
            with contextlib.closing(_connect_ro(path)) as con:
                return self._expected_rows(con)
        except sqlite3.DatabaseError:
            return None

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        path = self.sqlite_path()
        if not path.exists():
            self.download()
        check_tff_sqlite(path)
        con = _connect_ro(path)
        marks = ",".join("?" * len(self.splits))
        try:
            total = self._expected_rows(con)
            progress = Progress(log, total, f"{self.name}: rows")
            # NOT INDEXED: walk the table in rowid order even when the planner would
            # prefer the (split_name, client_id) index and then sort every page.
            sql = (
                "SELECT rowid, split_name, client_id, serialized_example_proto FROM examples NOT INDEXED "
                f"WHERE rowid > ? AND split_name IN ({marks}) ORDER BY rowid LIMIT ?"
            )
            last, left = -1 << 62, self.max_examples
            while left is None or left > 0:
                n = batch_rows if left is None else min(batch_rows, left)
                rows = con.execute(sql, [last, *self.splits, n]).fetchall()
                if not rows:
                    break
                last = rows[-1][0]
                yield self._decode(path, rows)
                progress.update(len(rows))
                if left is not None:
                    left -= len(rows)
        except sqlite3.DatabaseError as exc:
            raise DataError(f"{path}: reading the examples table failed ({exc}); the file may be corrupt.") from exc
        finally:
            con.close()
