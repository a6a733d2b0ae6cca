"""A user-named public (pretraining) corpus: `datasets.<name>.public`.

The study pretrains on C4 and fine-tunes on Stack Overflow / CC-News, so a
dataset of any source can name its own public corpus:

    public:
      path: /data/c4_subset.parquet   # a data file or folder, as for source local, or a .txt (one text per line)
      text_column: text                # default "text" (ignored for .txt: one text per line)
      format: auto                     # or parquet, csv, tsv, jsonl, txt, save_to_disk
      separator: null                  # a CSV's separator (null: found in the header)
      max_examples: 200000             # optional cap
    # or, instead of path:
      hub_name: allenai/c4             # datasets.load_dataset(hub_name, hub_config, split=hub_split, streaming=True)
      hub_config: en
      hub_split: validation

`open_source` (sources.py) wraps the dataset's Source in `WithPublicCorpus`
whenever the spec has a non-null `public` key, so `has_public`/`iter_public`
come from here for every source; for `synthetic` and `fortunes` this REPLACES
their built-in public part.

Everything is streamed as PUBLIC_SCHEMA record batches of at most
`batch_rows` texts: local files by userdp.data.tables (the reader of local
datasets too; only the text column is read), the hub with `streaming=True` (nothing but the rows read is downloaded, so a
`max_examples` cap on C4 fetches only the first files). The `download_data`
rule, a local rule, saves the streamed hub rows to
`data/<name>/public_hub-<hash>.parquet`, which later rules read, so compute
nodes without internet never touch the hub. Empty texts are
passed on; the prepare stage (`write_public`) drops and counts them.

Privacy: the public corpus is seen WITHOUT noise by the tokenizer and by
pretraining. It must not contain the private users' data; checking that is
the user's responsibility (a web crawl such as C4 may overlap a forum dump).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from ..errors import ConfigError, DataError
from ..io import ParquetBatchWriter
from .base import PUBLIC_SCHEMA
from .spec_keys import check_nested_keys, max_examples
from .tables import TableFile, as_text

log = logging.getLogger(__name__)

PUBLIC_KEYS = ("path", "text_column", "format", "separator", "max_examples", "hub_name", "hub_config", "hub_split")
DEFAULT_TEXT_COLUMN = "text"
DEFAULT_HUB_SPLIT = "train"


def check_public_spec(name: str, public: Any) -> dict:
    """Validate `datasets.<name>.public`; return it with defaults filled in.

    Raises ConfigError naming `datasets.<name>.public.<key>` for unknown keys,
    wrong types, and for both or neither of `path` / `hub_name`.
    """
    where = f"datasets.{name}.public"
    if not isinstance(public, dict):
        raise ConfigError(
            f"{where} is {public!r}; it must be a mapping with `path` (a local file or folder) or `hub_name` "
            "(a Hugging Face dataset). See config/README.md, section 'datasets: sources'."
        )
    check_nested_keys(name, "public", public, PUBLIC_KEYS, "a public corpus")
    has_path, has_hub = public.get("path") is not None, public.get("hub_name") is not None
    if has_path == has_hub:
        what = "both" if has_path else "neither"
        raise ConfigError(
            f"{where} has {what} of {where}.path and {where}.hub_name; give exactly one: `path` for a local "
            ".parquet/.jsonl/.csv/.txt file or folder of Parquet files, `hub_name` for a Hugging Face dataset."
        )
    for key in ("path", "hub_name", "hub_config", "hub_split", "text_column"):
        value = public.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{where}.{key} is {value!r}; it must be a non-empty string.")
    if has_path:
        for key in ("hub_config", "hub_split"):
            if public.get(key) is not None:
                raise ConfigError(f"{where}.{key} is only used with {where}.hub_name; remove it (path is set).")
    else:
        for key in ("format", "separator"):
            if public.get(key) is not None:
                raise ConfigError(f"{where}.{key} is only used with {where}.path; remove it (hub_name is set).")
    cap = max_examples(f"{name}.public", public)
    return {
        "path": public.get("path"),
        "hub_name": public.get("hub_name"),
        "hub_config": public.get("hub_config"),
        "hub_split": public.get("hub_split") or DEFAULT_HUB_SPLIT,
        "text_column": public.get("text_column") or DEFAULT_TEXT_COLUMN,
        "format": public.get("format") or "auto",
        "separator": public.get("separator"),
        "max_examples": cap,
    }


class PublicCorpus:
    """Reader of `datasets.<name>.public`: a local file/folder or a streamed hub dataset."""

    def __init__(self, name: str, public: Any, data_dir: str | Path):
        spec = check_public_spec(name, public)
        self.name = name
        self.key = f"datasets.{name}.public"
        self.data_dir = Path(data_dir)
        self.path = Path(spec["path"]).expanduser() if spec["path"] is not None else None
        self.hub_name, self.hub_config, self.hub_split = spec["hub_name"], spec["hub_config"], spec["hub_split"]
        self.text_column = spec["text_column"]
        self.max_examples = spec["max_examples"]
        self.n_read = 0
        self.table = None if self.path is None else TableFile(self.path, self.key, spec["format"], spec["separator"])

    # ---------------------------------------------------------------- naming

    @property
    def where(self) -> str:
        """The corpus as named in messages: its path or hub dataset."""
        if self.path is not None:
            return str(self.path)
        config = f", config {self.hub_config!r}" if self.hub_config else ""
        return f"hub dataset {self.hub_name!r}{config}, split {self.hub_split!r}"

    def _err(self, what: str) -> DataError:
        return DataError(f"{self.where} ({self.key}): {what}")

    @property
    def _fix(self) -> str:
        return f"Set {self.key}.text_column to the column that holds the text."

    def _missing_column(self, names: list[str]) -> DataError:
        return DataError(f"{self.where} ({self.key}): missing column(s) [{self.text_column!r}]; the dataset has "
                         f"columns {sorted(names)}. {self._fix}")

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        """Fail early (in the download rule) on a missing file, an unknown format or an empty folder."""
        if self.table is not None:
            self.table.check()

    # ---------------------------------------------------------------- readers

    def _iter_table(self, table: TableFile, batch_rows: int, column: str) -> Iterator[pa.Array]:
        for batch in table.batches([column], batch_rows, self._fix):
            yield table.text(batch.table.column(0), column, batch.locate)

    def _load_hub(self) -> Any:
        """The hub dataset as a streaming `datasets.IterableDataset` (nothing downloaded up front)."""
        import datasets  # heavy import, only when the hub is read

        try:
            return datasets.load_dataset(
                self.hub_name, self.hub_config, split=self.hub_split, streaming=True,
                cache_dir=str(self.data_dir / "hf_cache"),
            )
        except Exception as exc:  # datasets raises many types (not found, offline, bad config)
            raise self._err(
                f"loading failed: {type(exc).__name__}: {exc}; check {self.key}.hub_name / hub_config / hub_split "
                f"and the network, or set {self.key}.path to local files instead."
            ) from exc

    def _iter_hub(self, batch_rows: int) -> Iterator[pa.Array]:
        ds = self._load_hub()
        names = getattr(ds, "column_names", None)
        if names is not None:
            if self.text_column not in names:
                raise self._missing_column(list(names))
            if len(names) > 1 and hasattr(ds, "select_columns"):
                ds = ds.select_columns([self.text_column])  # do not decode url, timestamp, ...
        try:
            for batch in ds.with_format("arrow").iter(batch_size=batch_rows):
                if not isinstance(batch, pa.Table):
                    batch = pa.Table.from_pydict(batch)
                if self.text_column not in batch.column_names:
                    raise self._missing_column(batch.column_names)
                yield as_text(batch.column(self.text_column), self.text_column, lambda i: f"row {i + 1}", self._err)
        except DataError:
            raise
        except Exception as exc:  # network errors, bad shards, ... while streaming
            raise self._err(f"reading failed: {type(exc).__name__}: {exc}") from exc

    # ---------------------------------------------------------------- hub snapshot

    def snapshot_path(self) -> Path | None:
        """Where `download()` keeps the streamed hub rows (None for a local corpus).

        The name carries a hash of the hub name, config, split, text column and
        cap, so changing any of them fetches a new snapshot instead of reusing
        a stale one.
        """
        if self.path is not None:
            return None
        key = json.dumps([self.hub_name, self.hub_config, self.hub_split, self.text_column, self.max_examples])
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        return self.data_dir / f"public_hub-{digest}.parquet"

    def download(self, batch_rows: int = 10_000) -> None:
        """Hub corpus: stream it once (up to `max_examples`) into `snapshot_path()`.

        This runs in the `download_data` rule, a local rule, so that on a
        cluster whose compute nodes have no internet the later rules read the
        snapshot instead of the network. The file is written atomically; an
        existing snapshot is kept.
        """
        snap = self.snapshot_path()
        if snap is None:
            self.check()
            return
        if snap.exists():
            log.info("%s: public corpus snapshot %s already present", self.name, snap)
            return
        snap.parent.mkdir(parents=True, exist_ok=True)
        with ParquetBatchWriter(snap, PUBLIC_SCHEMA) as out:
            for batch in self.iter_batches(batch_rows):
                out.write(batch)
        log.info("%s: saved %d public texts from %s to %s", self.name, out.rows, self.where, snap)

    def _iter_arrays(self, batch_rows: int) -> Iterator[pa.Array]:
        snap = self.snapshot_path()
        if snap is not None and snap.exists():  # downloaded by the download rule: no network needed
            yield from self._iter_table(TableFile(snap, self.key, "parquet"), batch_rows, PUBLIC_SCHEMA.names[0])
        elif self.table is not None:
            yield from self._iter_table(self.table, batch_rows, self.text_column)
        else:
            yield from self._iter_hub(batch_rows)

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        """PUBLIC_SCHEMA batches of at most `batch_rows` texts, up to `max_examples` in all.

        A corpus without any row is a DataError naming the key and the file.
        """
        left = self.max_examples
        self.n_read = 0
        arrays = self._iter_arrays(batch_rows)
        try:
            for arr in arrays:
                for lo in range(0, len(arr), batch_rows):  # Parquet row groups / CSV blocks may be larger
                    piece = arr.slice(lo, batch_rows)
                    if left is not None:
                        piece = piece.slice(0, left)
                        left -= len(piece)
                    if len(piece):
                        self.n_read += len(piece)
                        yield pa.RecordBatch.from_arrays([piece], schema=PUBLIC_SCHEMA)
                    if left is not None and left <= 0:
                        break
                if left is not None and left <= 0:
                    break  # stop reading: for the hub, no further shards are fetched
        finally:
            arrays.close()
        if self.n_read == 0:
            txt = self.table is not None and self.table.format == "txt"
            raise (self.table.err if self.table is not None else self._err)(
                "the public corpus has no rows; it needs at least one text"
                + ("" if txt else f" in column {self.text_column!r}") + "."
            )
        log.info("%s: read %d public texts from %s", self.name, self.n_read, self.where)


class WithPublicCorpus:
    """A dataset Source whose public part is `datasets.<name>.public` (see module docstring).

    Everything but the public part is the wrapped source's: attributes and
    methods not defined here are delegated to it.
    """

    def __init__(self, source: Any, corpus: PublicCorpus):
        self.source = source
        self.corpus = corpus
        self.name = source.name
        self.spec = source.spec

    def __getattr__(self, attr: str) -> Any:
        # only called for attributes not found on the wrapper itself
        if attr in ("source", "corpus"):
            raise AttributeError(attr)
        return getattr(self.source, attr)

    @property
    def public_where(self) -> str:
        """`datasets.<name>.public` and its file or hub dataset, for messages."""
        return f"{self.corpus.key}: {self.corpus.where}"

    def download(self) -> None:
        """The source's download, then the public corpus's (a check of a local file, or a hub snapshot)."""
        self.source.download()
        self.corpus.download()

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        return self.source.iter_batches(batch_rows)

    def has_public(self) -> bool:
        return True

    def iter_public(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        return self.corpus.iter_batches(batch_rows)


def with_public(source: Any, name: str, spec: dict, data_dir: str | Path) -> Any:
    """`source` wrapped with its `datasets.<name>.public` corpus, or `source` itself when there is none."""
    if spec.get("public") is None:
        return source
    return WithPublicCorpus(source, PublicCorpus(name, spec["public"], data_dir))
