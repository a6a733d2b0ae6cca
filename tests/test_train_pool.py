"""Contribution bounding (docs/method.md section 2; invariant 10.3): at most G examples per train user, uniform, seeded."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from scipy import stats

from train_fixtures import tokens_table
from userdp.errors import DataError
from userdp.seeding import user_hashes
from userdp.training.pool import _canonical_order, _choose, build_pool, load_train_pool, read_train_tokens


@pytest.fixture()
def tokens_file(tmp_path):
    path = tmp_path / "tokens.parquet"
    pq.write_table(tokens_table(60, seed=1), path)
    return path


def test_bounding_caps_users_and_uses_only_train(tokens_file):
    table = pq.read_table(tokens_file)
    train = read_train_tokens(tokens_file)
    G = 3
    pool = build_pool(train, G, seed=7)
    # No user above G; users at or below G keep everything.
    n_u = {u: c for u, c in zip(*np.unique(train["user_id"].to_numpy(zero_copy_only=False), return_counts=True))}
    assert pool.user_sizes.max() <= G
    for u, m in zip(pool.user_ids, pool.user_sizes):
        assert m == min(n_u[u], G)
    assert pool.n_examples == sum(min(c, G) for c in n_u.values())
    assert any(c > G for c in n_u.values())  # the fixture really exercises the cap
    # Only train rows, and every pool row belongs to its user.
    split_of = dict(zip(table["example_id"].to_pylist(), table["split"].to_pylist()))
    user_of = dict(zip(table["example_id"].to_pylist(), table["user_id"].to_pylist()))
    assert {split_of[e] for e in pool.example_ids.tolist()} == {"train"}
    for row, e in enumerate(pool.example_ids.tolist()):
        assert user_of[e] == pool.user_ids[pool.example_user[row]]
    # Tokens of each row are the example's tokens.
    ids_of = dict(zip(table["example_id"].to_pylist(), table["input_ids"].to_pylist()))
    for row in range(0, pool.n_examples, 7):
        assert pool.tokens(row).tolist() == ids_of[int(pool.example_ids[row])]


def test_bounding_is_seeded_and_content_independent(tokens_file):
    train = read_train_tokens(tokens_file)
    a = build_pool(train, 2, seed=3)
    b = build_pool(train, 2, seed=3)
    c = build_pool(train, 2, seed=4)
    assert np.array_equal(a.example_ids, b.example_ids)
    assert not np.array_equal(a.example_ids, c.example_ids)
    # Changing the texts (token contents) and the row order does not change the choice.
    rng = np.random.default_rng(0)
    perm = rng.permutation(train.num_rows)
    scrambled = train.take(pa.array(perm)).set_column(
        2, "input_ids", pa.array([[5, 6, 7]] * train.num_rows, pa.list_(pa.int32()))
    )
    d = build_pool(scrambled, 2, seed=3)
    assert np.array_equal(a.example_ids, d.example_ids)


def test_bounding_subset_is_uniform():
    # One user with 8 examples, G = 2: over many seeds each example is kept with probability 2/8.
    table = pa.table({
        "user_id": ["a"] * 8 + ["b"],
        "example_id": list(range(9)),
        "input_ids": pa.array([[1, 2, 3]] * 9, pa.list_(pa.int32())),
    })
    n_seeds = 1500
    counts = np.zeros(8)
    for s in range(n_seeds):
        pool = build_pool(table, 2, seed=s)
        kept = pool.example_ids[pool.example_user == 0]
        assert len(kept) == 2
        counts[kept] += 1
    expected = np.full(8, n_seeds * 2 / 8)
    p = stats.chisquare(counts, expected).pvalue
    assert p > 1e-3, (counts, p)


def test_overlapping_splits_are_rejected(tmp_path):
    t = pa.table({
        "user_id": ["a", "a", "b"],
        "example_id": [0, 1, 2],
        "split": ["train", "test", "train"],
        "input_ids": pa.array([[1, 2, 3]] * 3, pa.list_(pa.int32())),
    })
    path = tmp_path / "tokens.parquet"
    pq.write_table(t, path)
    with pytest.raises(DataError, match="user-disjoint"):
        read_train_tokens(path)


def test_missing_columns_named(tmp_path):
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "split": ["train"]}), path)
    with pytest.raises(DataError, match="example_id"):
        read_train_tokens(path)


def _same_pool(a, b):
    for f in ("user_offsets", "example_ids", "example_user", "token_values", "token_offsets"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert a.user_ids == b.user_ids
    assert (a.group_size, a.n_examples_before_bounding) == (b.group_size, b.n_examples_before_bounding)


def test_streamed_pool_is_identical_to_in_memory_pool(tmp_path):
    # File order differs from the canonical (user, example id) order, with
    # many row groups and batches, so both passes cross batch boundaries.
    table = tokens_table(120, seed=5, median=7)
    table = table.take(pa.array(np.random.default_rng(0).permutation(table.num_rows)))
    path = tmp_path / "tokens.parquet"
    pq.write_table(table, path, row_group_size=41)
    train = read_train_tokens(path)
    for G, seed in ((1, 0), (3, 7), (1000, 11)):
        expected = build_pool(train, G, seed)
        _same_pool(load_train_pool(path, G, seed, batch_rows=17), expected)
        _same_pool(load_train_pool(path, G, seed), expected)
    assert load_train_pool(path, 3, 7).user_sizes.max() == 3


def test_blockwise_keys_give_the_same_choice():
    rng = np.random.default_rng(1)
    user_idx = np.repeat(np.arange(50), rng.integers(1, 20, 50))
    ex_ids = rng.permutation(len(user_idx)).astype(np.int64)
    perm = rng.permutation(len(user_idx))
    canonical = _canonical_order(user_idx[perm], ex_ids[perm])
    hashes = user_hashes([f"user{u}" for u in range(50)], seed=9)
    whole = _choose(*canonical, hashes, 4, block_rows=1 << 30)
    for block in (1, 5, 64):
        part = _choose(*canonical, hashes, 4, block_rows=block)
        for x, y in zip(whole, part):
            assert np.array_equal(x, y)


def test_streamed_pool_checks_like_read_train_tokens(tmp_path):
    base = {"input_ids": pa.array([[1, 2, 3]] * 3, pa.list_(pa.int32()))}
    overlap = tmp_path / "overlap.parquet"
    pq.write_table(pa.table({"user_id": ["a", "a", "b"], "example_id": [0, 1, 2],
                             "split": ["train", "test", "train"], **base}), overlap)
    with pytest.raises(DataError, match="user-disjoint"):
        load_train_pool(overlap, 2, 0)
    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"user_id": ["a", "a", "b"], "example_id": [0, 0, 2],
                             "split": ["train"] * 3, **base}), dup)
    with pytest.raises(DataError, match="duplicate"):
        load_train_pool(dup, 2, 0)
    no_train = tmp_path / "no_train.parquet"
    pq.write_table(pa.table({"user_id": ["a", "b", "c"], "example_id": [0, 1, 2],
                             "split": ["test"] * 3, **base}), no_train)
    with pytest.raises(DataError, match="no rows with split == 'train'"):
        load_train_pool(no_train, 2, 0)
    missing = tmp_path / "missing.parquet"
    pq.write_table(pa.table({"user_id": ["a"], "split": ["train"]}), missing)
    with pytest.raises(DataError, match="example_id"):
        load_train_pool(missing, 2, 0)


def _kept_by_user(pool):
    return {u: sorted(pool.example_ids[pool.user_offsets[i]:pool.user_offsets[i + 1]].tolist())
            for i, u in enumerate(pool.user_ids)}


def test_removing_one_user_leaves_every_other_choice_unchanged(tmp_path):
    # Neighbouring datasets (one user removed) must give bounded pools that
    # differ in that user's rows only, for the (public) seed actually used:
    # the DP argument needs Bound(D) and Bound(D') to be neighbours.
    train = tokens_table(80, seed=2, median=9, splits=(0.0, 0.0))
    G = 3
    users = sorted(set(train["user_id"].to_pylist()))
    for seed in (0, 5):
        full = _kept_by_user(build_pool(train, G, seed))
        assert sum(len(v) < n for v, n in zip(full.values(), np.unique(
            train["user_id"].to_numpy(zero_copy_only=False), return_counts=True)[1])) >= 10  # many users capped
        for gone in (users[0], users[len(users) // 2]):
            rest = train.filter(pc.not_equal(train["user_id"], gone))
            without = _kept_by_user(build_pool(rest, G, seed))
            assert without == {u: v for u, v in full.items() if u != gone}
            # the streamed route too
            path = tmp_path / f"rest_{seed}.parquet"
            pq.write_table(rest, path)
            assert _kept_by_user(load_train_pool(path, G, seed, batch_rows=29)) == without
            # prepare numbers examples contiguously over the dataset, so removing a
            # user shifts later users' ids: the kept ROWS (by rank) must not change
            renumbered = rest.set_column(rest.schema.get_field_index("example_id"), "example_id",
                                         pa.array(np.arange(rest.num_rows), pa.int64()))
            shift = dict(zip(renumbered["example_id"].to_pylist(), rest["example_id"].to_pylist()))
            moved = _kept_by_user(build_pool(renumbered, G, seed))
            assert {u: sorted(shift[e] for e in v) for u, v in moved.items()} == without


def test_kept_subset_is_uniform_over_seeds_and_users():
    # n = 6, G = 2: each of the 15 two-subsets must be equally likely, both for
    # one user over many seeds and over many users (same example ids) at one seed.
    n, G = 6, 2
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(100, 100 + n), G))}
    table = pa.table({
        "user_id": ["alice"] * n + ["bob"] * n,
        "example_id": list(range(100, 100 + n)) + list(range(200, 200 + n)),
        "input_ids": pa.array([[1, 2, 3]] * (2 * n), pa.list_(pa.int32())),
    })
    over_seeds = np.zeros(len(subsets))
    for s in range(1500):
        pool = build_pool(table, G, seed=s)
        over_seeds[subsets[tuple(sorted(pool.example_ids[pool.example_user == 0].tolist()))]] += 1
    n_users = 1500
    many = pa.table({
        "user_id": np.repeat([f"user{u}" for u in range(n_users)], n).tolist(),
        "example_id": np.tile(np.arange(100, 100 + n), n_users),
        "input_ids": pa.array([[1, 2]] * (n * n_users), pa.list_(pa.int32())),
    })
    pool = build_pool(many, G, seed=3)
    over_users = np.zeros(len(subsets))
    for u in range(n_users):
        kept = pool.example_ids[pool.user_offsets[u]:pool.user_offsets[u + 1]]
        over_users[subsets[tuple(sorted(kept.tolist()))]] += 1
    for counts in (over_seeds, over_users):
        p = stats.chisquare(counts).pvalue  # uniform expectation
        assert p > 1e-3, (counts, p)


def test_choice_does_not_depend_on_file_row_order(tmp_path):
    table = tokens_table(50, seed=4, median=6, splits=(0.0, 0.0))
    shuffled = table.take(pa.array(np.random.default_rng(1).permutation(table.num_rows)))
    reversed_ = table.take(pa.array(np.arange(table.num_rows)[::-1].copy()))
    a, b, c = (tmp_path / f"{k}.parquet" for k in "abc")
    pq.write_table(table, a)
    pq.write_table(shuffled, b, row_group_size=13)
    pq.write_table(reversed_, c)
    want = _kept_by_user(build_pool(table, 2, seed=8))
    assert _kept_by_user(build_pool(shuffled, 2, seed=8)) == want
    for path in (a, b, c):
        assert _kept_by_user(load_train_pool(path, 2, seed=8, batch_rows=31)) == want
