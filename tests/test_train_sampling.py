"""Poisson sampling at the accountant's level (invariant 10.1), and micro-batch packing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from scipy import stats

from train_fixtures import SEQ, tokens_table
from userdp.errors import ConfigError
from userdp.training.batching import pack_micro_batches, select_els, select_uls
from userdp.training.pool import build_pool
from userdp.seeding import derive_seed
from userdp.training.sampling import PoissonSampler
from userdp.training.settings import check_uls_fits


def _pool(G=4, n_users=80, seed=0):
    t = tokens_table(n_users, seed=seed)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    return build_pool(train, G, seed=1)


def poisson_checks(counts_per_item: np.ndarray, sizes: np.ndarray, n_items: int, q: float) -> tuple[float, float]:
    """(p-value of per-item inclusion counts vs Binomial(steps, q), realised-size variance / N q (1-q))."""
    steps = len(sizes)
    mean, var = steps * q, steps * q * (1 - q)
    chi2 = float(((counts_per_item - mean) ** 2 / var).sum())
    p = float(stats.chi2.sf(chi2, df=n_items))
    return p, float(np.var(sizes, ddof=1) / (n_items * q * (1 - q)))


def test_els_inclusion_is_poisson_over_examples():
    pool = _pool()
    q, steps = 0.1, 2000
    sampler = PoissonSampler.for_pool(pool, "examples", q, seed=derive_seed(0, "els"))
    counts = np.zeros(pool.n_examples)
    sizes, both, prev = [], 0, np.zeros(pool.n_examples, bool)
    for _ in range(steps):
        sel = select_els(pool, sampler.sample())
        counts[sel.rows] += 1
        sizes.append(sel.n_examples)
        now = np.zeros(pool.n_examples, bool)
        now[sel.rows] = True
        both += int((now & prev).sum())
        prev = now
    sizes = np.array(sizes)
    p, var_ratio = poisson_checks(counts, sizes, pool.n_examples, q)
    assert p > 1e-3
    # a unit's draws at consecutive steps are independent: P(in t and t + 1) = q^2
    pairs = (steps - 1) * pool.n_examples
    assert abs(both / pairs - q * q) < 4 * np.sqrt(q * q * (1 - q * q) / pairs)
    assert abs(var_ratio - 1) < 0.15
    assert abs(sizes.mean() - q * pool.n_examples) < 4 * np.sqrt(pool.n_examples * q * (1 - q) / steps)
    assert len(np.unique(sizes)) > 5  # realised sizes vary


def test_uls_inclusion_is_poisson_over_users():
    pool = _pool()
    q, steps = 0.15, 2000
    sampler = PoissonSampler.for_pool(pool, "users", q, seed=derive_seed(0, "uls"))
    counts = np.zeros(pool.n_users)
    sizes, rows_per_step = [], []
    for _ in range(steps):
        users = sampler.sample()
        sel = select_uls(pool, users)
        counts[users] += 1
        sizes.append(sel.n_units)
        rows_per_step.append(sel.n_examples)
        # every sampled user brings all its bounded examples
        assert sel.n_examples == int(pool.user_sizes[users].sum())
    p, var_ratio = poisson_checks(counts, np.array(sizes), pool.n_users, q)
    assert p > 1e-3
    assert abs(var_ratio - 1) < 0.15
    # realised compute matches q * N_G in expectation
    assert abs(np.mean(rows_per_step) / (q * pool.n_examples) - 1) < 0.05


def test_checks_reject_fixed_size_batches():
    """Negative control: a shuffled fixed-size sampler passes per-item frequencies but fails the size test."""
    n, q, steps = 200, 0.1, 2000
    rng = np.random.default_rng(0)
    counts, sizes = np.zeros(n), []
    for _ in range(steps):
        idx = rng.permutation(n)[: int(n * q)]
        counts[idx] += 1
        sizes.append(len(idx))
    _, var_ratio = poisson_checks(counts, np.array(sizes), n, q)
    assert abs(var_ratio - 1) > 0.5
    # and a sampler with the wrong rate fails the frequency test
    sampler = PoissonSampler([f"u{i}" for i in range(n)], 0.12, seed=1)
    counts = np.zeros(n)
    for _ in range(steps):
        counts[sampler.sample()] += 1
    p, _ = poisson_checks(counts, np.full(steps, 1.0), n, q)
    assert p < 1e-3


def _users(n):
    return [f"u{i:04d}" for i in range(n)]


def test_sampler_state_roundtrip():
    """The state is (seed, step): a sampler built with another (e.g. a fresh secret) seed continues the saved one."""
    a = PoissonSampler(_users(500), 0.05, seed=3)
    for _ in range(5):
        a.sample()
    state = a.state_dict()
    assert state["seed"] == 3 and state["step"] == 5
    expected = [a.sample() for _ in range(5)]
    b = PoissonSampler(_users(500), 0.05, seed=999)
    assert not all(np.array_equal(x, y) for x, y in zip(expected, [b.sample() for _ in range(5)]))
    b.load_state_dict(state)
    got = [b.sample() for _ in range(5)]
    assert all(np.array_equal(x, y) for x, y in zip(expected, got))
    with pytest.raises(ValueError):
        PoissonSampler(_users(400), 0.05, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="scheme"):
        b.load_state_dict({**state, "scheme": "pcg64"})


def test_sampler_rate_edges():
    assert len(PoissonSampler(_users(50), 0.0, seed=1).sample()) == 0
    assert PoissonSampler(_users(50), 1.0, seed=1).sample().tolist() == list(range(50))


def _without_user(pool_table, user):
    """The tokens table minus one user, example ids renumbered contiguously as prepare does."""
    kept = pool_table.filter(pc.not_equal(pool_table["user_id"], user))
    return kept.set_column(kept.schema.get_field_index("example_id"), "example_id",
                           pa.array(np.arange(kept.num_rows), pa.int64()))


@pytest.mark.parametrize("unit", ["users", "examples"])
def test_removing_a_user_changes_no_other_units_draws(unit):
    """The draws are keyed by unit identity (user id, rank in the user), not by position: on D minus
    user u every other unit is sampled at exactly the same steps (with one numpy stream, removing a
    user shifted every later unit's draws), and ULS's per-user row subsets are the same too."""
    t = tokens_table(80, seed=0)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    full = build_pool(train, 6, seed=1)
    victim = full.user_ids[len(full.user_ids) // 3]
    small = build_pool(_without_user(train, victim), 6, seed=1)
    a = PoissonSampler.for_pool(full, unit, 0.3, seed=7)
    b = PoissonSampler.for_pool(small, unit, 0.3, seed=7)

    def ident(pool, rows):  # (user id, rank among the user's pool rows) of pool rows
        users = pool.example_user[rows]
        return [(pool.user_ids[u], int(r - pool.user_offsets[u])) for u, r in zip(users, rows)]

    shifted = 0
    for _ in range(30):
        sa, sb = a.sample(), b.sample()
        if unit == "users":
            ua = [full.user_ids[i] for i in sa if full.user_ids[i] != victim]
            assert ua == [small.user_ids[i] for i in sb]
            sel_a = select_uls(full, sa, 2, a.subset_keys)
            sel_b = select_uls(small, sb, 2, b.subset_keys)
            ra = [x for x in ident(full, sel_a.rows) if x[0] != victim]
            assert ra == ident(small, sel_b.rows)
        else:
            ia = [x for x in ident(full, sa) if x[0] != victim]
            assert ia == ident(small, sb)
        # the identities line up although the positions moved
        shifted += int(len(sb) and not np.array_equal(sa[: len(sb)], sb))
    assert shifted > 0


def test_uls_subset_is_uniform():
    """k of a user's m rows by smallest keyed draw: every k-subset equally likely, fresh every step."""
    users = ["alice", "bob"]
    s = PoissonSampler(users, 1.0, seed=11)
    m, k, steps = 6, 2, 3000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(steps):
        s.sample()
        keys = s.subset_keys(np.zeros(m, np.int64), np.arange(m))
        pick = tuple(sorted(np.argsort(keys)[:k].tolist()))
        counts[pick] = counts.get(pick, 0) + 1
    assert len(counts) == 15
    obs = np.array(list(counts.values()), dtype=float)
    assert stats.chisquare(obs).pvalue > 1e-3


def test_packing_fixed_shapes_whole_users():
    pool = _pool(G=4)
    users = np.arange(0, pool.n_users, 2)
    sel = select_uls(pool, users)
    P = 6
    mbs = pack_micro_batches(pool, sel, P, SEQ, pad_id=0)
    assert sum(mb.n_rows for mb in mbs) == sel.n_examples
    seen_users = 0
    for mb in mbs:
        assert mb.input_ids.shape == (P, SEQ) and mb.attention_mask.shape == (P, SEQ)
        assert mb.unit_ids.shape == (P,) and mb.row_weights.shape == (P,)
        pad = mb.unit_ids < 0
        assert torch.all(mb.attention_mask[pad] == 0) and torch.all(mb.row_weights[pad] == 0)
        assert torch.all(pad[mb.n_rows:]) and not torch.any(pad[: mb.n_rows])
        for u in torch.unique(mb.unit_ids[~pad]).tolist():
            w = mb.row_weights[mb.unit_ids == u]
            # a user's weights are 1/m_u and sum to 1: its gradient is the mean
            assert torch.allclose(w.sum(), torch.tensor(1.0))
            seen_users += 1
    assert seen_users == len(users)  # nobody split across micro-batches (each counted once per batch)
    # ELS: unit ids unique per row, weights 1
    sel = select_els(pool, np.arange(13))
    mbs = pack_micro_batches(pool, sel, 5, SEQ, pad_id=0)
    assert [mb.n_rows for mb in mbs] == [5, 5, 3]
    assert torch.all(mbs[0].row_weights == 1) and len(torch.unique(mbs[0].unit_ids)) == 5
    # tokens placed left-aligned with attention on exactly the real tokens
    row = int(sel.rows[0])
    toks = pool.tokens(row)
    assert mbs[0].input_ids[0, : len(toks)].tolist() == toks.tolist()
    assert int(mbs[0].attention_mask[0].sum()) == len(toks)
    assert pack_micro_batches(pool, select_els(pool, np.zeros(0, np.int64)), 5, SEQ, 0) == []


def test_uls_examples_per_user_option():
    pool = _pool(G=6)
    users = np.flatnonzero(pool.user_sizes > 2)
    sampler = PoissonSampler.for_pool(pool, "users", 0.5, seed=0)
    sampler.sample()
    sel = select_uls(pool, users, examples_per_user=2, subset_keys=sampler.subset_keys)
    assert np.all(sel.unit_sizes == 2)
    assert np.allclose(sel.weights, 0.5)
    starts = np.concatenate([[0], np.cumsum(sel.unit_sizes)])
    for k, u in enumerate(users):
        rows = sel.rows[starts[k]:starts[k + 1]]
        assert np.all(pool.example_user[rows] == u)


def test_uls_requires_users_to_fit():
    with pytest.raises(ConfigError, match="training.physical_batch_size"):
        check_uls_fits(group_size=16, physical_batch_size=8, examples_per_user=None)
    check_uls_fits(group_size=16, physical_batch_size=8, examples_per_user=8)
