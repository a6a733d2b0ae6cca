"""CC-News through Hugging Face `datasets`; users are the publishing domains.

Spec keys (`datasets.<name>.<key>`), defaults in brackets:

- `hub_name` [`vblagoje/cc_news`]: the hub dataset (columns title, text,
  domain, date, description, url, image_url).
- `hub_split` [`train`]: the split to load.
- `streaming` [false]: stream from the hub instead of downloading it into the
  cache (`<data dir>/hf_cache`) first.
- `path` [null]: a Parquet file, or a folder of Parquet files, in the hub's
  schema. Then it is read with `load_dataset("parquet", data_files=...)`,
  the same code path as the hub, and nothing is downloaded.
- `include_title` [false]: text = title + blank line + text. Off by default,
  as in the study, which fine-tunes on the article text.
- `max_examples` [null]: stop after this many articles.

user_id = `domain`; rows whose domain is null or empty have no privacy unit
and are dropped (counted in the log). Empty texts are passed through (the
prepare stage drops and counts them). CC-News has no source split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DataError
from ..logutil import Progress
from .base import RAW_SCHEMA, NoPublicPart
from .sources import source_keys
from .spec_keys import check_keys, max_examples

log = logging.getLogger(__name__)

DEFAULT_HUB_NAME = "vblagoje/cc_news"
DEFAULT_HUB_SPLIT = "train"
HUB_COLUMNS = ("title", "text", "domain", "date", "description", "url", "image_url")


class CCNewsSource(NoPublicPart):
    """CC-News articles grouped by domain, read in batches through `datasets`."""

    def __init__(self, name: str, spec: dict, data_dir: Path, seed: int = 0):
        check_keys(name, spec, source_keys("cc_news"))
        self.name, self.spec, self.data_dir, self.seed = name, spec, Path(data_dir), seed
        self.path = Path(spec["path"]).expanduser() if spec.get("path") else None
        self.hub_name = spec.get("hub_name") or DEFAULT_HUB_NAME
        self.hub_split = spec.get("hub_split") or DEFAULT_HUB_SPLIT
        self.streaming = bool(spec.get("streaming", False))
        self.include_title = bool(spec.get("include_title", False))
        self.max_examples = max_examples(name, spec)
        self.dropped_no_domain = 0

    @property
    def where(self) -> str:
        """How the data is named in messages: the local path or the hub name."""
        return str(self.path) if self.path is not None else f"hub dataset {self.hub_name!r} (split {self.hub_split!r})"

    def _parquet_files(self) -> list[str]:
        assert self.path is not None
        if self.path.is_dir():
            files = sorted(str(p) for p in self.path.rglob("*.parquet"))
            if not files:
                raise DataError(
                    f"{self.path} (datasets.{self.name}.path) holds no .parquet files; point it at "
                    "Parquet file(s) in the CC-News schema " + f"({', '.join(HUB_COLUMNS)})."
                )
            return files
        if not self.path.is_file():
            raise DataError(f"{self.path} (datasets.{self.name}.path) does not exist.")
        return [str(self.path)]

    def _load(self) -> Any:
        """The `datasets` Dataset/IterableDataset, local Parquet or hub."""
        import datasets  # heavy import, only when the source is read

        cache_dir = str(self.data_dir / "hf_cache")
        try:
            if self.path is not None:
                files = self._parquet_files()
                return datasets.load_dataset(
                    "parquet", data_files={"train": files}, split="train",
                    streaming=self.streaming, cache_dir=cache_dir,
                )
            return datasets.load_dataset(
                self.hub_name, split=self.hub_split, streaming=self.streaming, cache_dir=cache_dir
            )
        except DataError:
            raise
        except Exception as exc:  # datasets raises many types (not found, offline, bad files)
            hint = (
                "check that the files are Parquet in the CC-News schema"
                if self.path is not None
                else f"check datasets.{self.name}.hub_name / hub_split and the network, or set "
                f"datasets.{self.name}.path to local Parquet files"
            )
            raise DataError(f"loading {self.where} failed: {type(exc).__name__}: {exc}; {hint}.") from exc

    def download(self) -> None:
        """Load once so the hub files land in the cache (no-op for streaming or a local path)."""
        if self.path is None and not self.streaming:
            self._load()

    def _needed(self) -> list[str]:
        return ["domain", "text"] + (["title"] if self.include_title else [])

    def _check_columns(self, names: list[str] | None) -> None:
        if names is None:
            return
        missing = [c for c in self._needed() if c not in names]
        if missing:
            raise DataError(
                f"{self.where} lacks column(s) {missing}; it has {sorted(names)}. Expected the CC-News "
                f"schema ({', '.join(HUB_COLUMNS)})."
            )

    def _to_raw(self, batch: pa.Table) -> pa.RecordBatch:
        self._check_columns(batch.column_names)
        users = batch.column("domain").cast(pa.string())
        texts = batch.column("text").cast(pa.string())
        if self.include_title:
            titles = pc.fill_null(batch.column("title").cast(pa.string()), "")
            texts = pc.binary_join_element_wise(titles, texts, "\n\n")
        keep = pc.and_(pc.is_valid(users), pc.not_equal(pc.utf8_trim_whitespace(users), ""))
        keep = pc.fill_null(keep, False)
        n_keep = pc.sum(keep).as_py() or 0
        self.dropped_no_domain += batch.num_rows - n_keep
        table = pa.table(
            [users, texts, pa.nulls(batch.num_rows, pa.string())], schema=RAW_SCHEMA
        )
        if n_keep < batch.num_rows:
            table = table.filter(keep)
        if table.num_rows == 0:
            return pa.RecordBatch.from_pylist([], schema=RAW_SCHEMA)
        return table.combine_chunks().to_batches()[0]

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        ds = self._load()
        self._check_columns(getattr(ds, "column_names", None))
        total = len(ds) if hasattr(ds, "__len__") and not self.streaming else None
        if self.max_examples is not None and total is not None:
            total = min(total, self.max_examples)
        progress = Progress(log, total, f"{self.name}: articles")
        left = self.max_examples
        self.dropped_no_domain = 0
        try:
            batches = ds.with_format("arrow").iter(batch_size=batch_rows)
            for batch in batches:
                if not isinstance(batch, pa.Table):
                    batch = pa.Table.from_pydict(batch)
                if left is not None:
                    if left <= 0:
                        break
                    batch = batch.slice(0, left)
                    left -= batch.num_rows
                progress.update(batch.num_rows)
                out = self._to_raw(batch)
                if out.num_rows:
                    yield out
        except DataError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise DataError(f"reading {self.where} failed: {type(exc).__name__}: {exc}") from exc
        if self.dropped_no_domain:
            log.warning("%s: dropped %d articles with no domain (no user)", self.name, self.dropped_no_domain)
