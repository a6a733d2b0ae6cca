"""The bounded training pool: train users' examples after contribution bounding.

Method section 2: each train user keeps at most G examples, a uniformly
random subset drawn with a seeded RNG that never looks at the content. The
pool stores the kept token sequences flat (values + offsets, like an Arrow
list array) so that a corpus of millions of examples costs one int32 per
token, not a padded matrix. Examples are grouped by user: user `u` owns pool
rows `user_offsets[u]:user_offsets[u + 1]`, which is what user-level
sampling needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import DataError

TOKEN_COLUMNS = ["user_id", "example_id", "split", "input_ids"]


@dataclass
class TrainingPool:
    """Train examples after bounding, grouped by user (users sorted by id)."""

    user_ids: list[str]          # [N] train users, sorted
    user_offsets: np.ndarray     # [N + 1] int64: user u owns rows user_offsets[u]:user_offsets[u+1]
    example_ids: np.ndarray      # [N_G] int64
    example_user: np.ndarray     # [N_G] int64 user index of each row
    token_values: np.ndarray     # flat int32 tokens of all rows
    token_offsets: np.ndarray    # [N_G + 1] int64
    group_size: int              # G
    n_examples_before_bounding: int

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    @property
    def n_examples(self) -> int:
        """N_G = sum_u min(n_u, G)."""
        return int(self.example_ids.shape[0])

    @property
    def user_sizes(self) -> np.ndarray:
        """m_u = min(n_u, G) per user."""
        return np.diff(self.user_offsets)

    def tokens(self, row: int) -> np.ndarray:
        return self.token_values[self.token_offsets[row]:self.token_offsets[row + 1]]


def read_train_tokens(path: str | Path) -> pa.Table:
    """Read tokens.parquet, check its columns and that splits are user-disjoint; return train rows."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist; run the data stage (rule tokenize) first.")
    names = pq.ParquetFile(path).schema_arrow.names
    missing = [c for c in TOKEN_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{path} lacks column(s) {missing}; a tokens table needs {TOKEN_COLUMNS}. Rebuild it with the data stage.")
    # Splits must be user-disjoint: check on the id columns only, then read
    # the tokens of train rows alone (validation/test tokens are never loaded).
    ids = pq.read_table(path, columns=["user_id", "split"])
    train_mask = pc.equal(ids["split"], "train")
    train_users = pc.unique(ids["user_id"].filter(train_mask))
    other_users = pc.unique(ids["user_id"].filter(pc.invert(train_mask)))
    shared = pc.filter(other_users, pc.is_in(other_users, value_set=train_users)) if len(other_users) else []
    if len(shared):
        raise DataError(
            f"{path}: {len(shared)} user(s) appear both in the train split and in validation/test "
            f"(e.g. {sorted(shared.to_pylist())[:3]}); splits must be user-disjoint. Rebuild the data stage."
        )
    del ids
    train = pq.read_table(path, columns=["user_id", "example_id", "input_ids"], filters=[("split", "==", "train")])
    if train.num_rows == 0:
        raise DataError(f"{path} has no rows with split == 'train'; nothing to fine-tune on.")
    return train


def build_pool(train: pa.Table, group_size: int, seed: int) -> TrainingPool:
    """Bound each user to at most `group_size` examples, chosen uniformly at random.

    The choice depends only on (seed, user_id, example_id) order, never on the
    text: rows are first put in a canonical order (user, example id), then each
    row gets an independent uniform key and each user keeps its G smallest keys
    (a uniformly random G-subset).
    """
    if group_size < 1:
        raise DataError(f"group size G must be >= 1, got {group_size}")
    users = train["user_id"].to_numpy(zero_copy_only=False).astype(str)
    ex_ids = train["example_id"].to_numpy().astype(np.int64)
    order = np.lexsort((ex_ids, users))
    users, ex_ids = users[order], ex_ids[order]
    if np.any((users[1:] == users[:-1]) & (ex_ids[1:] == ex_ids[:-1])):
        raise DataError("tokens table has duplicate (user_id, example_id) rows in the train split; example_id must be unique.")
    uniq, user_idx = np.unique(users, return_inverse=True)
    rng = np.random.default_rng(seed)
    keys = rng.random(len(users))
    # Sort by (user, random key); rank within user < G is kept.
    by_key = np.lexsort((keys, user_idx))
    starts = np.searchsorted(user_idx[by_key], np.arange(len(uniq)))
    rank = np.arange(len(by_key)) - np.repeat(starts, np.bincount(user_idx, minlength=len(uniq)))
    keep = by_key[rank < group_size]
    # Keep pool rows in canonical (user, example id) order.
    keep.sort()
    kept_rows = order[keep]
    kept_users = user_idx[keep]
    counts = np.bincount(kept_users, minlength=len(uniq))
    user_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    ids_col = train["input_ids"].take(pa.array(kept_rows))
    ids_col = ids_col.combine_chunks() if isinstance(ids_col, pa.ChunkedArray) else ids_col
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TrainingPool(
        user_ids=[str(u) for u in uniq],
        user_offsets=user_offsets,
        example_ids=ex_ids[keep],
        example_user=kept_users.astype(np.int64),
        token_values=values,
        token_offsets=offsets,
        group_size=int(group_size),
        n_examples_before_bounding=int(len(users)),
    )
