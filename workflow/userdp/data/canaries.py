"""Canary users for the user-level membership audit (docs/audits.md, "Auditing the released model").

A canary is a synthetic user whose every example is the same distinctive
sequence: bos + a prefix of `prefix_length` tokens + a secret of
`secret_length` tokens + eos. The prefix is the canary's key (the prompt of
the extraction test); the secret is what the audit scores. How the secret is
drawn is the canary design (`audit.canary_design`, after Panda et al. 2025,
"Privacy Auditing of Large Language Models"):

* `random`: token ids uniform over the vocabulary (special tokens excluded),
  the prefix too; with `prefix_length` 0 the canary of the first audit
  (bos + secret + eos).
* `new_token`: token ids uniform over the tokens that never occur in the
  corpus (`CorpusStats`: the dataset's token table, every split, and the
  pretraining corpus): their embeddings never received a gradient from
  real text, the closest a fixed vocabulary comes to Panda et al.'s newly
  added tokens.
* `rare_bigram`: tokens that do occur in the corpus, chained so that no two
  neighbours (the last prefix token and the first secret token included)
  ever follow each other in it: each token in-distribution, each bigram
  unseen (Panda et al.'s model-free bigram canary, with the corpus's bigram
  counts as the bigram model).

The prefix of `new_token` and `rare_bigram` canaries is drawn from the
tokens that occur in the corpus, so the secret is what is unusual.

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

from .chat import LOSS_MASK
from ..errors import ConfigError, DataError
from ..io import ParquetBatchWriter, flat_lists, read_table, streaming_parquet
from ..seeding import AUDIT_USERS_PERSON, derive_seed, user_hashes

CANARY_PREFIX = "canary-"
#: Probability that a canary is included (the one-run audit's coin).
INCLUSION_PROBABILITY = 0.5
CANARY_COLUMNS = ("user_id", "included", "n_examples", "input_ids", "prefix", "secret", "design", "candidates")
#: audit.canary_design values.
DESIGNS = ("random", "new_token", "rare_bigram")
#: Draws per secret token before `rare_bigram` gives up on finding an unseen bigram.
_BIGRAM_TRIES = 1000


#: audit.secret_length when null and the sequence length allows it.
DEFAULT_SECRET_LENGTH = 16


def resolved_secret_length(config: Mapping) -> int:
    """audit.secret_length, or null's value: min(16, sequence_length - 2 - prefix_length) (the canary fits)."""
    value = config["audit"].get("secret_length")
    if value is not None:
        return int(value)
    prefix = int(config["audit"].get("prefix_length") or 0)
    return min(DEFAULT_SECRET_LENGTH, int(config["tokenizer"]["sequence_length"]) - 2 - prefix)


@dataclass(frozen=True)
class CanarySpec:
    """The audit's canary settings (config keys audit.canaries, examples_per_canary, secret_length, seed,
    canary_design, prefix_length)."""

    n_canaries: int
    examples_per_canary: int
    secret_length: int
    seed: int
    design: str = "random"
    prefix_length: int = 0
    candidates: int = 0

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise ConfigError(f"audit.canary_design is {self.design!r}; choose one of {list(DESIGNS)}.")

    @classmethod
    def from_config(cls, config: dict) -> "CanarySpec":
        """From a validated config (userdp.config checks that the canary fits the sequence length)."""
        a = config["audit"]
        return cls(int(a["canaries"]), int(a["examples_per_canary"]), resolved_secret_length(config), int(a["seed"]),
                   str(a.get("canary_design", "random")), int(a.get("prefix_length") or 0),
                   int(a.get("exposure_candidates") or 0))

    @property
    def needs_corpus(self) -> bool:
        """Whether the design (or an in-distribution prefix) reads the corpus's token statistics."""
        return self.design != "random"


@dataclass(frozen=True)
class CorpusStats:
    """Which tokens and bigrams occur in the corpus (the dataset's token table and the pretraining corpus).

    `counts[t]` is the number of occurrences of token t; `bigrams` the sorted
    unique keys a * vocab_size + b of the adjacent pairs (a, b) within a row.
    """

    counts: np.ndarray
    bigrams: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.counts.size)

    def has_bigram(self, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
        key = np.asarray(a, np.int64) * self.vocab_size + np.asarray(b, np.int64)
        i = np.searchsorted(self.bigrams, key)
        return (i < self.bigrams.size) & (self.bigrams[np.minimum(i, self.bigrams.size - 1)] == key)


def corpus_stats(paths, vocab_size: int, batch_rows: int = 1 << 16) -> CorpusStats:
    """Token counts and the set of bigrams of the `input_ids` of every row of the token tables `paths`."""
    counts = np.zeros(int(vocab_size), dtype=np.int64)
    keys: list[np.ndarray] = []
    for path in paths:
        for batch in streaming_parquet(path).iter_batches(batch_size=batch_rows, columns=["input_ids"]):
            values, offsets = flat_lists(batch.column(0), np.int64)
            if values.size == 0:
                continue
            if values.max() >= vocab_size or values.min() < 0:
                raise DataError(f"{path}: token id {int(values.max())} outside the vocabulary of {vocab_size}; "
                                "rebuild it with the data stage (rule tokenize).")
            counts += np.bincount(values, minlength=vocab_size)
            pair = np.ones(values.size - 1, dtype=bool)
            starts = offsets[1:-1]  # a row's first token does not follow the previous row's last one
            pair[starts[(starts > 0) & (starts < values.size)] - 1] = False
            keys.append(np.unique(values[:-1][pair] * vocab_size + values[1:][pair]))
            keys = [np.unique(np.concatenate(keys))]
    return CorpusStats(counts, keys[0] if keys else np.zeros(0, np.int64))


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


def _pools(spec: CanarySpec, meta: dict, corpus: CorpusStats | None) -> tuple[np.ndarray, np.ndarray]:
    """(prefix pool, secret pool) of the design: token ids the prefix and the secret are drawn from."""
    special = {int(meta[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if meta.get(k) is not None}
    allowed = np.array([t for t in range(int(meta["vocab_size"])) if t not in special], dtype=np.int64)
    if allowed.size < 2:
        raise DataError(f"the tokenizer has {int(meta['vocab_size'])} tokens; canary secrets need at least 2 "
                        "non-special ones.")
    if spec.design == "random":
        return allowed, allowed
    if corpus is None:
        raise ValueError(f"canary design {spec.design!r} needs the corpus's token statistics (corpus_stats)")
    if corpus.vocab_size < int(meta["vocab_size"]):
        raise DataError(f"the corpus statistics cover {corpus.vocab_size} tokens, the tokenizer has "
                        f"{int(meta['vocab_size'])}; rebuild the data stage.")
    seen = allowed[corpus.counts[allowed] > 0]
    unseen = allowed[corpus.counts[allowed] == 0]
    if seen.size < 2:
        raise DataError("fewer than 2 non-special tokens occur in the corpus; the corpus is empty or broken.")
    if spec.design == "new_token":
        if unseen.size < 2:
            raise ConfigError(
                f"audit.canary_design new_token needs tokens that never occur in the corpus, and only {unseen.size} "
                f"of the {allowed.size} non-special tokens do not: use audit.canary_design rare_bigram (or random).")
        return seen, unseen
    return seen, seen


def _rare_bigram_secrets(rng: np.random.Generator, pool: np.ndarray, first_prev: np.ndarray, length: int,
                         corpus: CorpusStats) -> np.ndarray:
    """Secrets of `length` tokens from `pool`, each token forming an unseen bigram with the one before it.

    The first token's predecessor is `first_prev` (the prefix's last token,
    or -1 for none). Each position is drawn uniformly among the pool tokens
    that make an unseen bigram, by rejection sampling.
    """
    n = first_prev.size
    out = np.zeros((n, length), dtype=np.int64)
    prev = first_prev.copy()
    for j in range(length):
        tok = pool[rng.integers(0, pool.size, size=n)]
        todo = (prev >= 0) & corpus.has_bigram(np.maximum(prev, 0), tok)
        tries = 0
        while todo.any():
            tries += 1
            if tries > _BIGRAM_TRIES:
                raise DataError(f"no unseen bigram after {_BIGRAM_TRIES} draws: the corpus uses almost every pair of "
                                "its tokens; use audit.canary_design new_token or random.")
            tok[todo] = pool[rng.integers(0, pool.size, size=int(todo.sum()))]
            todo = todo & corpus.has_bigram(np.maximum(prev, 0), tok)
        out[:, j] = tok
        prev = tok
    return out


def draw_secrets(spec: CanarySpec, meta: dict, rng: np.random.Generator, prefixes: np.ndarray,
                 corpus: CorpusStats | None = None) -> np.ndarray:
    """Secrets of the design for canaries with these prefixes (one row each): the canaries' own, or the
    candidates that their exposure ranks them against (userdp.evaluation.audit)."""
    _, secret_pool = _pools(spec, meta, corpus)
    n = prefixes.shape[0]
    if spec.design == "rare_bigram":
        first_prev = prefixes[:, -1].astype(np.int64) if prefixes.shape[1] else np.full(n, -1, np.int64)
        return _rare_bigram_secrets(rng, secret_pool, first_prev, spec.secret_length, corpus)
    return secret_pool[rng.integers(0, secret_pool.size, size=(n, spec.secret_length))]


def make_canaries(spec: CanarySpec, meta: dict, config_seed: int, dataset: str,
                  corpus: CorpusStats | None = None) -> pa.Table:
    """The canary table: one row per canary (CANARY_COLUMNS), coins, prefixes and secrets from the audit's seed.

    `input_ids` is the canary's example (bos + prefix + secret + eos), which
    each of its `n_examples` training examples repeats; `candidates` are
    `spec.candidates` other secrets of the design for the same prefix (the
    exposure's reference set). `corpus` (which
    tokens and bigrams occur) is needed by every design but `random`.
    """
    if spec.n_canaries < 2:
        raise ConfigError(f"audit.canaries is {spec.n_canaries}; the audit needs at least 2 canaries.")
    prefix_pool, _ = _pools(spec, meta, corpus)
    rng = np.random.default_rng(derive_seed(int(config_seed), dataset, spec.seed, "audit-canaries"))
    included = rng.random(spec.n_canaries) < INCLUSION_PROBABILITY
    prefixes = prefix_pool[rng.integers(0, prefix_pool.size, size=(spec.n_canaries, spec.prefix_length))]
    secrets = draw_secrets(spec, meta, rng, prefixes, corpus)
    # The candidates the exposure ranks each secret among: the same design's secrets for the same prefix, from
    # their own stream (the canaries do not depend on how many candidates there are).
    crng = np.random.default_rng(derive_seed(int(config_seed), dataset, spec.seed, "audit-candidates"))
    cand = draw_secrets(spec, meta, crng, np.repeat(prefixes, spec.candidates, axis=0), corpus)
    cand = cand.reshape(spec.n_canaries, spec.candidates, spec.secret_length)
    bos, eos = int(meta["bos_token_id"]), int(meta["eos_token_id"])
    seqs = [[bos, *p, *s, eos] for p, s in zip(prefixes.tolist(), secrets.tolist())]
    return pa.table({
        "user_id": pa.array(canary_ids(spec.n_canaries), pa.string()),
        "included": pa.array(included, pa.bool_()),
        "n_examples": pa.array([spec.examples_per_canary] * spec.n_canaries, pa.int64()),
        "input_ids": pa.array(seqs, pa.list_(pa.int32())),
        "prefix": pa.array(prefixes.tolist(), pa.list_(pa.int32())),
        "secret": pa.array(secrets.tolist(), pa.list_(pa.int32())),
        "design": pa.array([spec.design] * spec.n_canaries, pa.string()),
        "candidates": pa.array(cand.tolist(), pa.list_(pa.list_(pa.int32()))),
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
        # chat data: a canary is a plain sequence, every token of it a target
        LOSS_MASK: pa.array([[True] * len(s) for s in seqs], pa.list_(pa.bool_())),
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
