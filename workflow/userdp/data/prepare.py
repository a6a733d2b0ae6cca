"""Cleaning, user grouping, the seeded user-level split and contribution statistics.

`prepare_dataset` consumes a Source's record batches in a streaming pass and
writes `examples.parquet`, `users.parquet` and `contributions.json` (see
docs/artifacts.md, "Data"). Memory is bounded by the number of
USERS (one small count table), never by the number of examples: texts go
straight from the source to Parquet, grouping is done with pyarrow's hash
aggregation, and the split is a pure function of the user id.

Split rules
-----------
- Default: user u goes to test if h(u) < test, to validation if
  h(u) < test + validation, else to train, where h is a seeded 64-bit hash
  of the user id mapped to [0, 1). It depends only on the id and the seed, so
  it is the same whatever the order or batching of the data, and a user's
  examples can never straddle two splits.
- `split.use_source_split` (default true) for sources that carry their own
  user-disjoint split in `source_split` (Stack Overflow): rows of `train` ->
  train; `heldout` users (disjoint from train) -> evaluation, divided between
  validation and test by the same hash in the ratio validation : test; rows
  of the source's `test` split are DROPPED (counted): they are later posts of
  the train users, and evaluating on them would not be user-level.

Privacy note: contribution statistics (counts per user, quantiles) are
computed on the private data. As in the study, they are treated as public
(like dataset sizes in standard DP-SGD practice); the JSON says so in
`treated_as_public`. With `private_stats` (`privacy.contribution_stats.private`)
the JSON and the log hold only the public sizes, the number of users per
split (`public_view`); the G rules then read the DP histogram instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DataError
from .chat import FRAMING_META, Framing
from ..io import ParquetBatchWriter, streaming_parquet, write_json, write_parquet
from ..logutil import Progress
from ..seeding import SPLIT_PERSON, unit_interval, user_hashes
from .base import PUBLIC_SCHEMA

SPLITS = ("train", "validation", "test")
TRAIN, VALIDATION, TEST = 0, 1, 2
DROP = -1

EXAMPLES_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string()),
        pa.field("example_id", pa.int64()),
        pa.field("split", pa.string()),
        pa.field("text", pa.string()),
    ]
)


def examples_schema(kind: str) -> pa.Schema:
    """examples.parquet's schema; chat and instruction examples record their framing (data.chat) in its metadata."""
    return EXAMPLES_SCHEMA if kind == "text" else EXAMPLES_SCHEMA.with_metadata({FRAMING_META: kind})


USERS_SCHEMA = pa.schema(
    [pa.field("user_id", pa.string()), pa.field("split", pa.string()), pa.field("n_examples", pa.int64())]
)

# Source splits (use_source_split) -> our split; EVAL = validation/test by hash.
EVAL = -2
SOURCE_SPLIT_RULES = {"train": TRAIN, "heldout": EVAL, "test": DROP}

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)

log = logging.getLogger("userdp.data.prepare")


def split_settings(spec: dict) -> tuple[float, float, bool]:
    """(validation, test, use_source_split) of a dataset spec, with defaults 0.1, 0.1, true (the config schema
    keeps each fraction in [0, 1), userdp.config their sum below 1)."""
    split = spec.get("split") or {}
    return float(split.get("validation", 0.1)), float(split.get("test", 0.1)), bool(split.get("use_source_split", True))


# ---------------------------------------------------------------- hashing


def _split_hash(user_ids: pa.Array, seed: int) -> np.ndarray:
    """Each user id's split key in [0, 1): its keyed hash under the config seed (not the dataset: a user id lands
    in the same split in two datasets built from the same users)."""
    return unit_interval(user_hashes(user_ids.to_pylist(), seed, person=SPLIT_PERSON))


def hash_split(user_ids: pa.Array, seed: int, validation: float, test: float) -> np.ndarray:
    """Split codes (TRAIN/VALIDATION/TEST) per user id by the seeded hash."""
    return _split_codes(_split_hash(user_ids, seed), validation, test)


def _split_codes(u: np.ndarray, validation: float, test: float) -> np.ndarray:
    """Split codes of split keys `u` (`_split_hash`): TEST below test, VALIDATION below test + validation."""
    return np.where(u < test, TEST, np.where(u < test + validation, VALIDATION, TRAIN)).astype(np.int8)


def _eval_codes(u: np.ndarray, validation: float, test: float) -> np.ndarray:
    """Evaluation users (source heldout) of split keys `u` -> VALIDATION or TEST in the ratio validation : test."""
    share_test = 1.0 if validation + test == 0 else test / (validation + test)
    return np.where(u < share_test, TEST, VALIDATION).astype(np.int8)


def _per_user(fn, user_ids: pa.Array) -> np.ndarray:
    """Apply a per-id function on the distinct ids of a batch only (cheaper), then expand to the rows."""
    enc = pc.dictionary_encode(user_ids).combine_chunks() if isinstance(user_ids, pa.ChunkedArray) else pc.dictionary_encode(user_ids)
    codes = fn(enc.dictionary)
    return codes[enc.indices.to_numpy(zero_copy_only=False)]


# ---------------------------------------------------------------- cleaning


# Rows that may need cleaning: two ASCII whitespace in a row, a whitespace
# other than ' ', whitespace at either end, or any non-ASCII character
# (which may be Unicode whitespace). A regex MATCH is cheap; the rewrite is
# done only on these rows.
_NEEDS_CLEANING = r"\s\s|[\t\n\r\f\v]|^\s|\s$|[^\x00-\x7F]"


def clean_text(text: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Collapse runs of (Unicode) whitespace to one space and strip the ends; nulls stay null."""
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    needs = pc.fill_null(pc.match_substring_regex(text, _NEEDS_CLEANING), False)
    n_needs = pc.sum(needs).as_py() or 0
    if n_needs == 0:
        return text
    # split on runs of whitespace (ends give empty pieces, hence the trim)
    if n_needs == len(text):
        return pc.utf8_trim_whitespace(pc.binary_join(pc.utf8_split_whitespace(text), " "))
    fixed = pc.utf8_trim_whitespace(pc.binary_join(pc.utf8_split_whitespace(pc.filter(text, needs)), " "))
    return pc.replace_with_mask(text, needs, fixed)


def _capped(batches: Iterable[pa.RecordBatch], limit: int | None) -> Iterator[pa.RecordBatch]:
    if limit is None:
        yield from batches
        return
    left = limit
    for b in batches:
        if left <= 0:
            return
        if b.num_rows > left:
            b = b.slice(0, left)
        left -= b.num_rows
        yield b


# ---------------------------------------------------------------- the stage


class _CountTable:
    """Per-user counts, merged with hash aggregation whenever the buffer grows.

    Merged when the parts hold `flush_rows` rows OR number `flush_parts`: a
    part costs ~8 KB whatever its size, and a source that stores users'
    rows together (Stack Overflow) gives parts of a few rows each, so
    without the part bound the buffer would grow with the number of batches,
    i.e. with the rows read (~120 MB for the full release at 10k-row batches).
    """

    def __init__(self, flush_rows: int = 2_000_000, flush_parts: int = 256):
        self.parts: list[pa.Table] = []
        self.rows = 0
        self.flush_rows = flush_rows
        self.flush_parts = flush_parts

    def add(self, user_id: pa.Array, split: np.ndarray) -> None:
        t = pa.table({"user_id": user_id, "split": pa.array(split, pa.int8())})
        g = t.group_by("user_id").aggregate([("split", "min"), ("split", "max"), ("split", "count")])
        self.parts.append(g.rename_columns(["user_id", "split_min", "split_max", "n"]))
        self.rows += g.num_rows
        if (self.rows > self.flush_rows or len(self.parts) > self.flush_parts) and len(self.parts) > 1:
            self.parts = [self.result()]
            self.rows = self.parts[0].num_rows

    def result(self) -> pa.Table:
        if not self.parts:
            return pa.table({"user_id": pa.array([], pa.string()), "split_min": pa.array([], pa.int8()),
                             "split_max": pa.array([], pa.int8()), "n": pa.array([], pa.int64())})
        t = pa.concat_tables(self.parts)
        g = t.group_by("user_id").aggregate([("split_min", "min"), ("split_max", "max"), ("n", "sum")])
        return g.rename_columns(["user_id", "split_min", "split_max", "n"])


def _assign_splits(batch: pa.RecordBatch, seed: int, validation: float, test: float, use_source: bool) -> np.ndarray:
    """Split code per row (TRAIN/VALIDATION/TEST, or DROP for source test rows)."""
    u = _per_user(lambda d: _split_hash(d, seed), batch.column("user_id"))  # one hash per distinct id of the batch
    codes = _split_codes(u, validation, test)
    if not use_source or "source_split" not in batch.schema.names:
        return codes
    src = batch.column("source_split")
    if src.null_count == len(src):
        return codes
    known = pc.is_in(src, value_set=pa.array(list(SOURCE_SPLIT_RULES)))
    bad = pc.and_(pc.is_valid(src), pc.invert(known))
    if pc.any(bad).as_py():
        values = pc.unique(pc.filter(src, bad)).to_pylist()
        raise DataError(
            f"source split value(s) {values[:5]} not understood; known: {sorted(SOURCE_SPLIT_RULES)}. "
            "Set datasets.<name>.split.use_source_split: false to split users by hash instead."
        )
    src_np = np.asarray(src.to_numpy(zero_copy_only=False), dtype=object)
    mapped = np.full(len(src_np), 127, dtype=np.int8)  # 127 = no source split (null)
    for value, code in SOURCE_SPLIT_RULES.items():
        mapped[src_np == value] = code
    out = np.where(mapped == 127, codes, mapped).astype(np.int8)
    is_eval = out == EVAL
    if is_eval.any():
        out[is_eval] = _eval_codes(u[is_eval], validation, test)
    return out


def prepare_dataset(
    source,
    name: str,
    spec: dict,
    out_dir: str | Path,
    seed: int,
    batch_rows: int = 100_000,
    write_rows: int = 131_072,
    private_stats: bool = False,
) -> dict:
    """Clean, group, split and count one dataset; write its artifacts into `out_dir`.

    Writes examples.parquet, users.parquet and contributions.json (all
    atomically; on an error none of them is left behind) and returns the
    statistics written to contributions.json. With `private_stats` that is
    `public_view` of them, and the log reports no row counts (the examples of
    the train users are a statistic of their counts).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    validation, test, use_source = split_settings(spec)
    min_n = int(spec.get("min_examples_per_user", 1))
    limit = spec.get("max_examples")
    dropped = {"null_or_empty_text": 0, "source_test_rows": 0, "below_min_examples_per_user": 0}
    dropped_users = {"below_min_examples_per_user": 0}
    counts = _CountTable()
    pass1 = out_dir / ".examples.pass1.parquet"
    labels = pa.array(SPLITS, pa.string())
    n_raw = 0
    schema = examples_schema(Framing.of_spec(name, spec).kind)
    try:
        next_id = 0
        with ParquetBatchWriter(pass1, schema) as writer:
            buf: list[pa.Table] = []
            buffered = 0
            # with DP contribution statistics no row count is logged
            progress = None if private_stats else Progress(log, _expected_rows(source, limit), f"{name}: rows read")
            for batch in _capped(source.iter_batches(batch_rows), limit):
                n_raw += batch.num_rows
                if progress is not None:
                    progress.update(batch.num_rows)
                uid = batch.column("user_id")
                if uid.null_count:
                    raise DataError(
                        f"dataset {name}: {uid.null_count} row(s) have a null user id; "
                        "every example needs a user (fix the data or its user column)."
                    )
                text = clean_text(batch.column("text"))
                keep = pc.fill_null(pc.greater(pc.utf8_length(text), 0), False).to_numpy(zero_copy_only=False)
                dropped["null_or_empty_text"] += int((~keep).sum())
                split = _assign_splits(batch, seed, validation, test, use_source)
                src_drop = keep & (split == DROP)
                dropped["source_test_rows"] += int(src_drop.sum())
                keep &= split != DROP
                if not keep.any():
                    continue
                if keep.all():  # the common case: no copies
                    uid_k, split_k, text_k = uid, split, text
                else:
                    idx = pa.array(np.nonzero(keep)[0])
                    uid_k, split_k, text_k = uid.take(idx), split[keep], text.take(idx)
                counts.add(uid_k, split_k)
                n = len(split_k)
                buf.append(
                    pa.table(
                        {
                            "user_id": uid_k,
                            "example_id": pa.array(np.arange(next_id, next_id + n, dtype=np.int64)),
                            "split": labels.take(pa.array(split_k.astype(np.int64))),
                            "text": text_k,
                        },
                        schema=schema,
                    )
                )
                next_id += n
                buffered += n
                if buffered >= write_rows:
                    writer.write(pa.concat_tables(buf))
                    buf, buffered = [], 0
            if buf:
                writer.write(pa.concat_tables(buf))

        users = counts.result()
        mixed = pc.not_equal(users.column("split_min"), users.column("split_max"))
        if pc.any(mixed).as_py():
            example = pc.filter(users.column("user_id"), mixed)[0].as_py()
            raise DataError(
                f"dataset {name}: user {example!r} has rows in more than one source split, so the source's "
                "split is not user-disjoint; set datasets."
                f"{name}.split.use_source_split: false to split users by hash."
            )
        small = pc.less(users.column("n"), min_n)
        n_small = int(pc.sum(small).as_py() or 0)
        if n_small:
            dropped_users["below_min_examples_per_user"] = n_small
            dropped["below_min_examples_per_user"] = int(pc.sum(pc.filter(users.column("n"), small)).as_py())
            users = users.filter(pc.invert(small))
        if users.num_rows == 0:
            raise DataError(
                f"dataset {name}: no users left after filtering ({n_raw} raw rows read; "
                f"min_examples_per_user={min_n}, split.use_source_split={use_source}; dropped: {dropped}). "
                f"Lower datasets.{name}.min_examples_per_user or check the data's user and text columns."
            )
        users = pa.table(
            {
                "user_id": users.column("user_id"),
                "split": labels.take(pc.cast(users.column("split_min"), pa.int64())),
                "n_examples": pc.cast(users.column("n"), pa.int64()),
            },
            schema=USERS_SCHEMA,
        ).sort_by("user_id")

        examples_path = out_dir / "examples.parquet"
        if n_small:
            _filter_examples(pass1, examples_path, users.column("user_id"), batch_rows, schema)
        else:
            pass1.replace(examples_path)  # already complete; a rename is atomic
        stats = contribution_stats(users, dropped, dropped_users, n_raw)
        stats.update({"dataset": name, "source": spec.get("source"), "split_rule": _split_rule_text(validation, test, use_source), "min_examples_per_user": min_n})
        if private_stats:
            stats = public_view(stats)
            log.info("%s: users per split %s (row counts withheld: DP contribution statistics)", name, stats["n_users"])
        else:
            log.info("%s: %d rows read, %d users kept, dropped %s", name, n_raw, users.num_rows, dropped)
        write_parquet(out_dir / "users.parquet", users)
        write_json(out_dir / "contributions.json", stats)
        return stats
    except BaseException:
        for f in ("examples.parquet", "users.parquet", "contributions.json"):
            with contextlib.suppress(FileNotFoundError):
                (out_dir / f).unlink()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            pass1.unlink()


def _expected_rows(source, limit: int | None) -> int | None:
    """Rows the stage will read, for the progress ETA: the source's own count where
    it offers one cheaply (`expected_rows()`, e.g. Stack Overflow's client_metadata),
    capped by max_examples; None (rate only, no ETA) when unknown."""
    hint = getattr(source, "expected_rows", None)
    total = hint() if callable(hint) else None
    if limit is not None:
        total = min(total, int(limit)) if total is not None else int(limit)
    return total


def _filter_examples(src: Path, dst: Path, keep_users: pa.ChunkedArray, batch_rows: int,
                     schema: pa.Schema = EXAMPLES_SCHEMA) -> None:
    """Keep rows of `keep_users` from `src`, renumbering example_id contiguously."""
    keep_set = keep_users.combine_chunks()
    next_id = 0
    pf = streaming_parquet(src)
    with ParquetBatchWriter(dst, schema) as writer:
        for batch in pf.iter_batches(batch_size=max(batch_rows, 65536)):
            t = pa.Table.from_batches([batch]).filter(pc.is_in(batch.column("user_id"), value_set=keep_set))
            if t.num_rows == 0:
                continue
            ids = pa.array(np.arange(next_id, next_id + t.num_rows, dtype=np.int64))
            next_id += t.num_rows
            writer.write(t.set_column(1, "example_id", ids))


def _split_rule_text(validation: float, test: float, use_source: bool) -> str:
    rule = f"seeded hash of user_id: test {test:g}, validation {validation:g}, rest train"
    if use_source:
        rule += "; where the source has its own split: train->train, heldout->validation/test, test rows dropped"
    return rule


def contribution_stats(users: pa.Table, dropped: dict, dropped_users: dict, n_raw: int) -> dict:
    """The contents of contributions.json from the users table (user_id, split, n_examples)."""
    split = np.asarray(users.column("split").to_numpy(zero_copy_only=False), dtype=object)
    n = users.column("n_examples").to_numpy()
    out: dict = {
        "n_users": {s: int((split == s).sum()) for s in SPLITS},
        "n_examples": {s: int(n[split == s].sum()) for s in SPLITS},
    }
    tr = np.sort(n[split == "train"])
    if len(tr):
        out["median_train"] = float(np.median(tr))
        out["max_train"] = int(tr[-1])
        out["mean_train"] = float(tr.mean())
        out["quantiles_train"] = {f"{q:g}": float(np.quantile(tr, q)) for q in QUANTILES}
        edges = [2**k for k in range(int(math.floor(math.log2(tr[-1]))) + 2)]
        hist, _ = np.histogram(tr, bins=edges)
        out["histogram_train"] = {"bin_edges": edges, "counts": hist.tolist(), "bins": "log2: [edge_i, edge_{i+1})"}
        values, users_per = np.unique(tr, return_counts=True)
        out["frequency_train"] = {"n_examples": values.tolist(), "n_users": users_per.tolist()}
    else:
        out.update({"median_train": None, "max_train": None, "mean_train": None, "quantiles_train": {},
                    "histogram_train": {"bin_edges": [], "counts": []}, "frequency_train": {"n_examples": [], "n_users": []}})
    out["n_raw_examples"] = int(n_raw)
    out["dropped"] = dict(dropped)
    out["dropped_users"] = dict(dropped_users)
    out["treated_as_public"] = True
    out["privacy_note"] = (
        "Computed on the private data and treated as public, as in the study (Charles et al. 2024) "
        "and like dataset sizes in standard DP-SGD practice; they are not covered by the DP guarantee."
    )
    return out


#: contributions.json fields kept with DP contribution statistics: users per split and how the data was made.
PUBLIC_FIELDS = ("dataset", "source", "split_rule", "min_examples_per_user", "n_users")


def public_view(stats: dict) -> dict:
    """contributions.json with `privacy.contribution_stats.private`: the public sizes only.

    The number of users per split is public (docs/privacy.md, "What is treated
    as public"); every count of examples (per split, read, dropped) and every
    statistic of the train users' counts is left out. The G rules read the DP
    histogram (contributions_dp.json) instead.
    """
    out = {k: stats[k] for k in PUBLIC_FIELDS if k in stats}
    out["treated_as_public"] = False
    out["contribution_stats_private"] = True
    out["privacy_note"] = (
        "privacy.contribution_stats.private is on: only the number of users per split is published; the "
        "statistics of the train users' example counts are released with differential privacy in "
        "contributions_dp.json and no exact statistic of them is written (docs/privacy.md)."
    )
    return out


def write_public(source, name: str, path: str | Path, batch_rows: int = 100_000) -> dict:
    """Clean the source's public texts and write them to `path` (column `text`).

    Empty texts (after cleaning) are dropped and counted, as for private
    data; a public part with no non-empty text is a DataError (naming
    `datasets.<name>.public` and its file when the corpus is user-named).
    """
    if not source.has_public():
        raise DataError(
            f"dataset {name}: its source {getattr(source, 'spec', {}).get('source')!r} has no public part "
            f"(public pretraining text) to write; add datasets.{name}.public (see config/README.md)."
        )
    n, dropped = 0, 0
    with ParquetBatchWriter(path, PUBLIC_SCHEMA) as writer:
        for batch in source.iter_public(batch_rows):
            text = clean_text(batch.column("text"))
            keep = pc.fill_null(pc.greater(pc.utf8_length(text), 0), False)
            t = pa.table({"text": pc.filter(text, keep)}, schema=PUBLIC_SCHEMA)
            dropped += len(text) - t.num_rows
            if t.num_rows:
                writer.write(t)
                n += t.num_rows
        if n == 0:
            where = getattr(source, "public_where", None)
            raise DataError(
                f"dataset {name}: the public part{f' ({where})' if where else ''} has no non-empty text "
                f"({dropped} empty text(s) dropped)."
            )
    log.info("%s: %d public texts written, %d null or empty texts dropped", name, n, dropped)
    return {"n_public": n, "dropped_empty": dropped}
