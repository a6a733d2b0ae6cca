"""The bounded training pool: train users' examples after contribution bounding.

docs/method.md section 2: each train user keeps at most G examples, a uniformly
random subset keyed by (seed, user id, the row's rank among the user's rows
in example-id order) that never looks at the content. Each row's key is a
function of those alone (a keyed hash of the user id, mixed with the rank),
so a user's choice does not depend on which other users are in the table,
nor on the dataset-wide example numbering (which shifts when a user is
removed): removing one user changes only that
user's rows of the pool, for the very seed used, as the user-level DP
argument needs (Bound(D) and Bound(D') are neighbours). The
pool stores the kept token sequences flat (values + offsets, like an Arrow
list array) so that a corpus of millions of examples costs one int32 per
token, not a padded matrix. Examples are grouped by user: user `u` owns pool
rows `user_offsets[u]:user_offsets[u + 1]`, which is what user-level
sampling needs.

`load_train_pool` builds the pool from tokens.parquet in a streaming way
(the full Stack Overflow train split has ~135M rows): a first pass reads the
id columns only and chooses the kept rows, a second pass keeps the tokens of
those rows alone. Its result is identical to
`build_pool(read_train_tokens(path), G, seed)`, the in-memory route used on
small tables and in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..data.chat import LOSS_MASK
from ..errors import DataError
from ..io import flat_lists, read_table, streaming_parquet
from ..seeding import row_keys, user_hashes

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
    # flat bool aligned with token_values: whether each token is a loss target (chat and instruction data,
    # userdp.data.chat); None: every token after a row's first is one (plain text)
    loss_mask_values: np.ndarray | None = None

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

    def content_arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays that make up the pool's content (what a checkpoint's fingerprint digests)."""
        base = (self.user_offsets, self.example_ids, self.token_offsets, self.token_values)
        return base if self.loss_mask_values is None else (*base, self.loss_mask_values)

    def loss_mask(self, row: int) -> np.ndarray | None:
        """Which of the row's tokens are loss targets (None: all of them, plain text)."""
        if self.loss_mask_values is None:
            return None
        return self.loss_mask_values[self.token_offsets[row]:self.token_offsets[row + 1]]


def _check_tokens_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist; run the data stage (rule tokenize) first.")
    names = streaming_parquet(path).schema_arrow.names
    missing = [c for c in TOKEN_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{path} lacks column(s) {missing}; a tokens table needs {TOKEN_COLUMNS}. Rebuild it with the data stage.")
    return path


def _overlap_error(path: Path, shared: list[str]) -> DataError:
    return DataError(
        f"{path}: {len(shared)} user(s) appear both in the train split and in validation/test "
        f"(e.g. {sorted(shared)[:3]}); splits must be user-disjoint. Rebuild the data stage."
    )


def _no_train_error(path: Path) -> DataError:
    return DataError(f"{path} has no rows with split == 'train'; nothing to fine-tune on.")


def read_train_tokens(path: str | Path) -> pa.Table:
    """Read tokens.parquet, check its columns and that splits are user-disjoint; return train rows.

    Holds every train row's tokens in memory; `load_train_pool` streams instead.
    """
    path = _check_tokens_file(path)
    # Splits must be user-disjoint: check on the id columns only, then read
    # the tokens of train rows alone (validation/test tokens are never loaded).
    ids = read_table(path, columns=["user_id", "split"])
    train_mask = pc.equal(ids["split"], "train")
    train_users = pc.unique(ids["user_id"].filter(train_mask))
    other_users = pc.unique(ids["user_id"].filter(pc.invert(train_mask)))
    shared = pc.filter(other_users, pc.is_in(other_users, value_set=train_users)) if len(other_users) else []
    if len(shared):
        raise _overlap_error(path, shared.to_pylist())
    del ids
    columns = ["user_id", "example_id", "input_ids"]
    if LOSS_MASK in streaming_parquet(path).schema_arrow.names:
        columns.append(LOSS_MASK)
    train = read_table(path, columns=columns, filters=[("split", "==", "train")])
    if train.num_rows == 0:
        raise _no_train_error(path)
    return train


class _Choice(NamedTuple):
    kept_rows: np.ndarray     # [N_G] input row of each pool row, in canonical (user, example id) order
    example_ids: np.ndarray   # [N_G] int64
    kept_users: np.ndarray    # [N_G] int64 user index
    user_offsets: np.ndarray  # [N + 1] int64


def _canonical_order(user_idx: np.ndarray, ex_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, users, example ids) of the rows in canonical (user, example id) order.

    `user_idx[i]` is the rank of row i's user id among the sorted distinct ids
    (so sorting by it is sorting by the id). A stable sort: equal pairs keep
    their input order (they are rejected as duplicates anyway).
    """
    order = np.lexsort((ex_ids, user_idx))
    return order, user_idx[order], ex_ids[order]


def _has_adjacent_duplicates(users: np.ndarray, ex_sorted: np.ndarray, step: int = 1 << 22) -> bool:
    """Whether two neighbouring rows share (user, example id); in slices, so no
    boolean arrays over all rows."""
    last = len(users) - 1  # comparisons i vs i + 1 for i < last
    for lo in range(0, max(last, 0), step):
        hi = min(lo + step, last)
        if np.any((users[lo + 1:hi + 1] == users[lo:hi]) & (ex_sorted[lo + 1:hi + 1] == ex_sorted[lo:hi])):
            return True
    return False


def _choose(order: np.ndarray, users: np.ndarray, ex_sorted: np.ndarray, user_hash: np.ndarray, group_size: int,
            block_rows: int = 1 << 20) -> _Choice:
    """The bounded subset, from ids alone, given the canonical order (`_canonical_order`).

    `user_hash[u]` is `user_hashes` of the u-th sorted user id. Each row gets
    the key `row_keys(user_hash[user], rank of the row within its user)` and each user keeps its G
    smallest keys (ties by position: a stable sort; keys of one user never
    tie). As a row's key is a function of (seed, user id, example id) alone,
    the choice is the same whatever other users or row order the table has,
    and a block of whole users at a time gives the same choice as all rows at
    once, with memory for one block instead of several arrays over all rows.
    """
    if _has_adjacent_duplicates(users, ex_sorted):
        raise DataError("tokens table has duplicate (user_id, example_id) rows in the train split; example_id must be unique.")
    n_users = len(user_hash)
    starts = np.searchsorted(users, np.arange(n_users + 1))  # user u owns canonical rows starts[u]:starts[u+1]
    keep_parts = []
    a = 0
    while a < n_users:
        # users a..b-1: at least one user, at most ~block_rows rows unless one user has more
        b = max(a + 1, int(np.searchsorted(starts, starts[a] + block_rows, side="right")) - 1)
        b = min(b, n_users)
        lo, hi = int(starts[a]), int(starts[b])
        local_users = users[lo:hi]
        sizes = np.diff(starts[a:b + 1])
        rank = np.arange(hi - lo) - np.repeat(starts[a:b] - lo, sizes)  # position of each row within its user
        # Key on the row's position among its user's rows (in example-id order),
        # not on the example id itself: prepare numbers examples contiguously
        # over the whole dataset, so removing a user shifts every later user's
        # ids, but never the order of a user's own rows.
        keys = row_keys(user_hash[local_users], rank)
        by_key = np.lexsort((keys, local_users))  # within user by key; users stay in order
        keep = by_key[rank < group_size]
        keep.sort()
        keep_parts.append(keep + lo)
        a = b
    keep = np.concatenate(keep_parts) if keep_parts else np.zeros(0, np.int64)
    kept_users = users[keep].astype(np.int64)
    counts = np.bincount(kept_users, minlength=n_users)
    user_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return _Choice(order[keep], ex_sorted[keep], kept_users, user_offsets)


def _flat_mask(mask_col: pa.Array | pa.ChunkedArray, offsets: np.ndarray) -> np.ndarray:
    """The loss-mask column's values, flat, checked to line up with the tokens (`offsets`)."""
    values, mask_offsets = flat_lists(mask_col, bool)
    if not np.array_equal(mask_offsets, offsets):
        raise DataError(f"the tokens table's {LOSS_MASK} column does not line up with input_ids (a row's mask has "
                        "another length than its tokens); rebuild the data stage.")
    return values


def _pool(user_ids: list[str], choice: _Choice, values: np.ndarray, offsets: np.ndarray,
          group_size: int, n_before: int, mask: np.ndarray | None = None) -> TrainingPool:
    return TrainingPool(
        user_ids=user_ids,
        user_offsets=choice.user_offsets,
        example_ids=choice.example_ids,
        example_user=choice.kept_users,
        token_values=values,
        token_offsets=offsets,
        group_size=int(group_size),
        n_examples_before_bounding=int(n_before),
        loss_mask_values=mask,
    )


def build_pool(train: pa.Table, group_size: int, seed: int) -> TrainingPool:
    """Bound each user to at most `group_size` examples, chosen uniformly at random.

    The choice depends only on the seed, the user id and the order of the
    user's own example ids, never on the text, the row order in the file, the
    other users or the dataset-wide numbering: each row gets a uniform key from
    those (`row_keys`) and each user keeps its G smallest keys (a uniformly
    random G-subset).
    """
    if group_size < 1:
        raise DataError(f"group size G must be >= 1, got {group_size}")
    users = train["user_id"].to_numpy(zero_copy_only=False).astype(str)
    ex_ids = train["example_id"].to_numpy().astype(np.int64)
    uniq, user_idx = np.unique(users, return_inverse=True)
    del users
    choice = _choose(*_canonical_order(user_idx.reshape(-1), ex_ids), user_hashes(uniq, seed), group_size)
    kept = pa.array(choice.kept_rows)
    values, offsets = flat_lists(train["input_ids"].take(kept))
    mask = _flat_mask(train[LOSS_MASK].take(kept), offsets) if LOSS_MASK in train.column_names else None
    return _pool([str(u) for u in uniq], choice, values, offsets, group_size, len(ex_ids), mask)


def load_train_pool(path: str | Path, group_size: int, seed: int, batch_rows: int = 1 << 18) -> TrainingPool:
    """`build_pool(read_train_tokens(path), group_size, seed)`, streamed: same checks, same pool.

    Pass 1 reads (user_id, example_id, split) in batches, checks that splits
    are user-disjoint and chooses the kept rows; pass 2 reads input_ids in
    batches and keeps the tokens of the kept rows only. Memory:
    a few integers per train row plus the kept tokens, never all tokens.
    """
    if group_size < 1:
        raise DataError(f"group size G must be >= 1, got {group_size}")
    path = _check_tokens_file(path)
    pf = streaming_parquet(path)
    n_rows = pf.metadata.num_rows
    # Train rows' (user code, example id), filled in place: no list of parts to
    # concatenate (np.empty pages past the last train row are never touched).
    codes = np.empty(n_rows, np.int32)
    ex_ids = np.empty(n_rows, np.int64)
    is_train = np.zeros(n_rows, bool)
    code_of: dict[str, int] = {}  # user id -> code, in order of first appearance
    in_other = np.zeros(0, bool)
    seen_train = np.zeros(0, bool)
    row = n_train = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=["user_id", "example_id", "split"]):
        uid = batch.column("user_id")
        if uid.null_count:
            raise DataError(f"{path}: {uid.null_count} row(s) have a null user_id; rebuild the data stage.")
        if row + batch.num_rows > n_rows:
            raise DataError(f"{path} changed while it was read (more rows than its metadata says); rerun the job.")
        enc = pc.dictionary_encode(uid)
        batch_codes = np.fromiter((code_of.setdefault(u, len(code_of)) for u in enc.dictionary.to_pylist()),
                                  np.int64, len(enc.dictionary))
        if len(code_of) >= 2**31:
            raise DataError(f"{path}: more than 2**31 distinct user ids.")
        b_codes = batch_codes[enc.indices.to_numpy(zero_copy_only=False)]
        if len(code_of) > len(seen_train):
            grow = len(code_of) - len(seen_train)
            seen_train = np.concatenate([seen_train, np.zeros(grow, bool)])
            in_other = np.concatenate([in_other, np.zeros(grow, bool)])
        train = pc.fill_null(pc.equal(batch.column("split"), "train"), False).to_numpy(zero_copy_only=False)
        is_train[row:row + batch.num_rows] = train
        seen_train[b_codes[train]] = True
        in_other[b_codes[~train]] = True
        k = int(train.sum())
        codes[n_train:n_train + k] = b_codes[train]
        ex_ids[n_train:n_train + k] = batch.column("example_id").to_numpy(zero_copy_only=False)[train]
        row += batch.num_rows
        n_train += k
    shared = np.nonzero(seen_train & in_other)[0]
    if len(shared):
        names = list(code_of)
        raise _overlap_error(path, [names[c] for c in shared])
    if n_train == 0:
        raise _no_train_error(path)
    codes, ex_ids = codes[:n_train], ex_ids[:n_train]
    # Sorted distinct train user ids and each code's rank among them, with
    # numpy's string semantics exactly as build_pool's np.unique.
    train_codes = np.nonzero(seen_train)[0]
    names = np.array(list(code_of), dtype=object)[train_codes].astype(str)
    uniq, rank = np.unique(names, return_inverse=True)
    rank_of_code = np.full(len(code_of), -1, np.int32)
    rank_of_code[train_codes] = rank.reshape(-1)
    del code_of, names
    for lo in range(0, n_train, 1 << 20):  # codes -> ranks in place
        codes[lo:lo + (1 << 20)] = rank_of_code[codes[lo:lo + (1 << 20)]]
    order, users, ex_sorted = _canonical_order(codes, ex_ids)
    del codes, ex_ids  # only the canonical copies from here on
    choice = _choose(order, users, ex_sorted, user_hashes(uniq, seed), group_size)
    del order, users, ex_sorted

    # Pass 2: kept rows' tokens in file order, then put in canonical order.
    by_file = np.argsort(choice.kept_rows, kind="stable")
    wanted = choice.kept_rows[by_file]  # train-row positions to keep, ascending
    columns = ["input_ids"] + ([LOSS_MASK] if LOSS_MASK in pf.schema_arrow.names else [])
    pieces: dict[str, list[pa.Array]] = {c: [] for c in columns}
    row = 0    # file row of the batch's first row
    first = 0  # train-row position of the batch's first train row
    for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
        train = is_train[row:row + batch.num_rows]
        row += batch.num_rows
        k = int(train.sum())
        lo, hi = np.searchsorted(wanted, [first, first + k])
        if hi > lo:
            take = pa.array(np.nonzero(train)[0][wanted[lo:hi] - first])
            for c in columns:
                pieces[c].append(batch.column(c).take(take))
        first += k
    if row != len(is_train):
        raise DataError(f"{path} changed while it was read (row count differs); rerun the job.")
    canonical = np.empty_like(by_file)
    canonical[by_file] = np.arange(len(by_file))
    in_order = {c: pa.chunked_array(pieces[c], type=pf.schema_arrow.field(c).type).take(pa.array(canonical))
                for c in columns}
    values, offsets = flat_lists(in_order["input_ids"])
    mask = _flat_mask(in_order[LOSS_MASK], offsets) if LOSS_MASK in in_order else None
    return _pool([str(u) for u in uniq], choice, values, offsets, group_size, n_train, mask)
