"""Canary users for the user-level membership audit (docs/privacy.md, "Auditing the released model").

A canary is a synthetic user whose every example is the same distinctive
sequence: bos + a secret of `secret_length` token ids drawn uniformly from
the vocabulary (special tokens excluded) + eos. Random-token secrets are
out-of-distribution for any corpus, so a model that trained on a canary
predicts its secret better than one that did not, and the difference is the
canary's, not its neighbours'.

Each of the m canaries is included in training independently with
probability 1/2 (the one-run audit of Steinke, Nasr and Jagielski 2023 with
users as the unit). Secrets and coins come from one generator seeded by
(config seed, dataset, audit seed), so the audit is reproducible and the
scoring side knows which canaries were in.

`make_canaries` returns the canary table (every canary, included or not) and
`write_audit_tokens` streams the dataset's train rows (of all train users, or
of a seeded uniform subset of `audit.max_train_users` of them, so that the
audit of a large dataset stays small) plus the included canaries' rows into
the tokens table the audit trains on, with the schema (and its `userdp`
metadata) of the dataset's tokens.parquet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import ConfigError, DataError
from ..io import ParquetBatchWriter, read_table, streaming_parquet
from ..seeding import seed_sequence, user_hashes

CANARY_PREFIX = "canary-"
#: Probability that a canary is included (the one-run audit's coin).
INCLUSION_PROBABILITY = 0.5
CANARY_COLUMNS = ("user_id", "included", "n_examples", "input_ids", "secret")
#: blake2b personalisation of the hash that picks the audit's subset of train users.
AUDIT_USERS_PERSON = b"userdp.audit"


#: audit.secret_length when null and the sequence length allows it.
DEFAULT_SECRET_LENGTH = 16


def resolved_secret_length(config: Mapping) -> int:
    """audit.secret_length, or null's value: min(16, tokenizer.sequence_length - 2) (bos + secret + eos fit)."""
    value = config["audit"].get("secret_length")
    if value is not None:
        return int(value)
    return min(DEFAULT_SECRET_LENGTH, int(config["tokenizer"]["sequence_length"]) - 2)


@dataclass(frozen=True)
class CanarySpec:
    """The audit's canary settings (config keys audit.canaries, examples_per_canary, secret_length, seed)."""

    n_canaries: int
    examples_per_canary: int
    secret_length: int
    seed: int

    @classmethod
    def from_config(cls, config: dict) -> "CanarySpec":
        """From a validated config (userdp.config checks that bos + secret + eos fits the sequence length)."""
        a = config["audit"]
        return cls(int(a["canaries"]), int(a["examples_per_canary"]), resolved_secret_length(config), int(a["seed"]))


def tokens_meta(schema: pa.Schema, where: str) -> dict:
    """The `userdp` metadata of a tokens.parquet schema (vocabulary size and special ids)."""
    raw = (schema.metadata or {}).get(b"userdp")
    if raw is None:
        raise DataError(f"{where} has no 'userdp' schema metadata (vocab_size, special token ids); rebuild it with "
                        "the data stage (rule tokenize).")
    meta = json.loads(raw)
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        if meta.get(key) is None:
            raise DataError(f"{where}: the 'userdp' schema metadata lacks {key}; rebuild it with rule tokenize.")
    return meta


def canary_ids(n: int) -> list[str]:
    return [f"{CANARY_PREFIX}{i:05d}" for i in range(n)]


def make_canaries(spec: CanarySpec, meta: dict, config_seed: int, dataset: str) -> pa.Table:
    """The canary table: one row per canary (CANARY_COLUMNS), coins and secrets from the audit's seed.

    `input_ids` is the canary's example (bos + secret + eos), which each of
    its `n_examples` training examples repeats.
    """
    if spec.n_canaries < 2:
        raise ConfigError(f"audit.canaries is {spec.n_canaries}; the audit needs at least 2 canaries.")
    special = {int(meta[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if meta.get(k) is not None}
    allowed = np.array([t for t in range(int(meta["vocab_size"])) if t not in special], dtype=np.int32)
    if allowed.size < 2:
        raise DataError(f"the tokenizer has {int(meta['vocab_size'])} tokens; canary secrets need at least 2 "
                        "non-special ones.")
    rng = np.random.default_rng(seed_sequence(int(config_seed), dataset, spec.seed, "audit-canaries"))
    included = rng.random(spec.n_canaries) < INCLUSION_PROBABILITY
    secrets = allowed[rng.integers(0, allowed.size, size=(spec.n_canaries, spec.secret_length))]
    bos, eos = int(meta["bos_token_id"]), int(meta["eos_token_id"])
    seqs = [[bos, *s.tolist(), eos] for s in secrets]
    return pa.table({
        "user_id": pa.array(canary_ids(spec.n_canaries), pa.string()),
        "included": pa.array(included, pa.bool_()),
        "n_examples": pa.array([spec.examples_per_canary] * spec.n_canaries, pa.int64()),
        "input_ids": pa.array(seqs, pa.list_(pa.int32())),
        "secret": pa.array(secrets.tolist(), pa.list_(pa.int32())),
    })


def read_canaries(path: str | Path) -> pa.Table:
    """canaries.parquet, checked for its columns and for both included and excluded canaries."""

    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist; run rule audit_canaries first.")
    table = read_table(path)
    missing = [c for c in CANARY_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{path} lacks column(s) {missing}; rebuild it with rule audit_canaries.")
    return table


def _canary_rows(canaries: pa.Table, schema: pa.Schema, first_example_id: int) -> pa.Table:
    """Rows of the included canaries in the tokens schema: n_examples copies of each one's sequence."""
    inc = canaries.filter(canaries["included"])
    n_ex = inc["n_examples"].to_numpy()
    users = np.repeat(np.array(inc["user_id"].to_pylist(), dtype=object), n_ex)
    seqs = [s for s, k in zip(inc["input_ids"].to_pylist(), n_ex) for _ in range(int(k))]
    n = len(seqs)
    cols = {
        "user_id": pa.array(users.tolist(), pa.string()),
        "example_id": pa.array(np.arange(first_example_id, first_example_id + n, dtype=np.int64)),
        "split": pa.array(["train"] * n, pa.string()),
        "input_ids": pa.array(seqs, pa.list_(pa.int32())),
        "n_tokens": pa.array([len(s) for s in seqs], pa.int32()),
    }
    arrays = []
    for field in schema:
        if field.name in cols:
            arrays.append(cols[field.name].cast(field.type))
        else:  # e.g. source_example_id: a canary has no row in examples.parquet
            arrays.append(pa.nulls(n, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _train_mask(table: pa.Table) -> pa.Array:
    return pc.fill_null(pc.equal(table["split"], "train"), False)


def kept_train_users(tokens_path: str | Path, max_users: int | None, seed: int,
                     batch_rows: int = 1 << 16) -> pa.Array | None:
    """The train users the audit keeps: all (None), or the `max_users` with the smallest keyed hash of their id.

    The choice depends on the user ids and the seed only, never on the
    content, so it is a uniformly random subset of whole users.
    """
    if max_users is None:
        return None
    ids: set[str] = set()
    for batch in streaming_parquet(tokens_path).iter_batches(batch_size=batch_rows, columns=["user_id", "split"]):
        table = pa.Table.from_batches([batch])
        ids.update(pc.unique(table["user_id"].filter(_train_mask(table))).to_pylist())
    users = np.array(sorted(ids), dtype=object)
    if len(users) <= max_users:
        return None
    order = np.argsort(user_hashes(users.tolist(), seed, person=AUDIT_USERS_PERSON), kind="stable")
    return pa.array(users[np.sort(order[:max_users])].tolist(), pa.string())


def write_audit_tokens(tokens_path: str | Path, canaries: pa.Table, out_path: str | Path,
                       max_train_users: int | None = None, seed: int = 0, batch_rows: int = 1 << 16) -> dict:
    """Write the audit's training table: the dataset's train rows plus the included canaries' rows.

    Streams tokens.parquet (validation and test rows are left out: the audit
    only trains). With `max_train_users`, only that many train users (a
    seeded uniform subset of whole users, `kept_train_users`) keep their
    rows. Raises DataError if a dataset user id starts with the canary
    prefix. Returns counts for the log.
    """
    tokens_path = Path(tokens_path)
    pf = streaming_parquet(tokens_path)
    schema = pf.schema_arrow
    for col in ("user_id", "example_id", "split", "input_ids"):
        if col not in schema.names:
            raise DataError(f"{tokens_path} lacks column {col!r}; rebuild it with the data stage (rule tokenize).")
    kept = kept_train_users(tokens_path, max_train_users, seed, batch_rows)
    max_id, n_train = -1, 0
    with ParquetBatchWriter(out_path, schema) as writer:
        for batch in pf.iter_batches(batch_size=batch_rows):
            table = pa.Table.from_batches([batch], schema=schema)
            clash = pc.any(pc.starts_with(table["user_id"], CANARY_PREFIX)).as_py()
            if clash:
                raise DataError(f"{tokens_path}: a user id starts with {CANARY_PREFIX!r}, the audit's canary "
                                "prefix; rename that user in the source data.")
            if table.num_rows:
                max_id = max(max_id, int(pc.max(table["example_id"]).as_py()))
            mask = _train_mask(table)
            if kept is not None:
                mask = pc.and_(mask, pc.is_in(table["user_id"], value_set=kept))
            train = table.filter(mask)
            n_train += train.num_rows
            if train.num_rows:
                writer.write(train)
        rows = _canary_rows(canaries, schema, max_id + 1)
        writer.write(rows)
    return {"dataset_train_rows": n_train, "canary_rows": rows.num_rows,
            "dataset_train_users": None if kept is None else len(kept),
            "canaries_included": int(pc.sum(canaries["included"]).as_py() or 0),
            "canaries": canaries.num_rows}
