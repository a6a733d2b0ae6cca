"""The white-box audit of the mechanism (userdp.evaluation.mechanism_audit): it must catch broken mechanisms.

Mutation tests: each deliberate bug of tests/mechanism_mutations.py is
applied to the real engine / clipping / noise / accounting path for one
audited run, at the size stated next to it, and the audit must give an
empirical user-level epsilon lower bound ABOVE the claimed epsilon. Three
bugs are not caught by the epsilon bound at a size CI can run (docs/audits.md,
"White-box audit of the mechanism", has the power table and the reason: the
one-run bound of Steinke et al. reaches about 60% of a Gaussian mechanism's
epsilon at 1,000 canaries, so a factor 2 or sqrt(2) in the noise, and a
divisor that only leaks the batch count, stay below the claim); for those the
tests check that the audit sees them (the bound rises above the honest run's,
and the audit's exact noise and divisor checks fail), never that they pass.

The honest mechanism never exceeds its claim (many seeds, engine and a
numpy simulation of the Gaussian mechanism with known epsilon), and the
estimator's bound never exceeds the true epsilon of that simulated mechanism.
Engine runs and the many-seed checks are integration tests (seconds each);
the unit tests of the scores, the cell selection and the table are fast.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from scipy import optimize, stats

import mechanism_mutations as mm
from userdp.errors import ConfigError
from userdp.evaluation import mechanism_audit as ma
from userdp.privacy.adaptive import AdaptiveClipping

torch.set_num_threads(1)

# The sizes of the audited runs (power table: benchmarks/mechanism_audit_power.py)
FULL_BATCH = dict(canaries=1000, group_size=4, sampling_rate=1.0, steps=4, delta=1e-6, clip_norm=1e-3,
                  other_users=50, physical_batch_size=256)
#: Small q, many steps: a different unit is first in each step's micro-batch (mutation b), batches vary (f).
SMALL_Q = dict(canaries=1000, group_size=1, sampling_rate=0.005, steps=400, delta=1e-6, clip_norm=1e-3,
               other_users=0, physical_batch_size=256)


def setup(method: str, eps: float, size: dict, **kw) -> ma.CellSetup:
    return ma.CellSetup(method=method, epsilon=eps, **{**size, **kw})


_CACHE: dict = {}


def audited(mutation: str, s: ma.CellSetup) -> dict:
    key = (mutation, s)
    if key not in _CACHE:
        with mm.MUTATIONS[mutation]():
            _CACHE[key] = ma.audit_cell(s)
    return _CACHE[key]


# ---------------------------------------------------------------- mutations the epsilon bound catches

CAUGHT = [
    # (b) one unit per micro-batch unclipped: with q small a different canary is first in each of the 400 steps
    ("clipping_skipped_for_one_unit", "uls", 2.0, SMALL_Q),
    # (c) the accountant is given q / 4 while the sampler runs q
    ("accounting_rate_smaller", "els", 2.0, FULL_BATCH),
    ("accounting_rate_smaller", "uls", 1.0, FULL_BATCH),
    # (d) ELS accounted with G = 1 while every user has G = 4 examples
    ("els_accounted_with_g1", "els", 2.0, FULL_BATCH),
]


@pytest.mark.integration
@pytest.mark.parametrize("mutation,method,eps,size", CAUGHT, ids=[f"{c[0]}-{c[1]}-eps{c[2]:g}" for c in CAUGHT])
def test_mutation_is_caught(mutation, method, eps, size):
    s = setup(method, eps, size)
    bad = audited(mutation, s)
    honest = audited("honest", s)
    assert honest["epsilon_lower_bound"] <= honest["epsilon_claimed"]
    assert bad["bound_exceeds_claim"] and bad["epsilon_lower_bound"] > bad["epsilon_claimed"], bad
    assert bad["epsilon_lower_bound"] > honest["epsilon_lower_bound"]


#: q = 1 (each canary's release exactly Gaussian: the f-DP bound applies) with enough canaries for it to see (a)
FDP_SIZE = dict(FULL_BATCH, canaries=3000, other_users=0)


@pytest.mark.integration
def test_noise_halved_is_caught_by_the_fdp_bound_at_3000_canaries():
    """(a) Half the noise at claimed 4, 3,000 canaries, q = 1: the f-DP bound exceeds the claim (simulated: 5 of
    5 seeds, 4.2-5.7; the honest mechanism 1.7-2.5 over 30 seeds), the (epsilon, delta) bound does not."""
    s = setup("uls", 4.0, FDP_SIZE)
    bad, honest = audited("noise_halved", s), audited("honest", s)
    assert bad["fdp_bound_exceeds_claim"] and bad["bound_exceeds_claim"], bad
    assert bad["epsilon_lower_bound_fdp"] > bad["epsilon_claimed"] > bad["epsilon_lower_bound"]
    assert not honest["bound_exceeds_claim"] and honest["epsilon_lower_bound_fdp"] <= honest["epsilon_claimed"]
    assert honest["epsilon_lower_bound_fdp"] > honest["epsilon_lower_bound"]  # tighter


# ---------------------------------------------------------------- mutations only the exact checks catch at CI size


@pytest.mark.integration
def test_noise_halved_is_seen_but_not_above_the_claim_at_1000_canaries():
    """(a) Half the noise: the (epsilon, delta) bound rises (0.51 -> 1.38 at claimed 2) but stays below the claim
    at m = 1,000 (the one-run bound of a Gaussian mechanism: docs/audits.md; the f-DP bound catches it at
    3,000 canaries, above); the noise check measures the ratio exactly."""
    s = setup("uls", 2.0, FULL_BATCH)
    bad, honest = audited("noise_halved", s), audited("honest", s)
    assert bad["epsilon_lower_bound"] > 2 * honest["epsilon_lower_bound"] > 0
    assert bad["noise_check_failed"] and not honest["noise_check_failed"]
    assert bad["noise_std_ratio"] == pytest.approx(0.5, rel=0.03)
    assert honest["noise_std_ratio"] == pytest.approx(1.0, rel=0.03)


@pytest.mark.integration
def test_division_by_the_realised_size_is_seen_by_the_divisor_check():
    """(f) Dividing by the realised count: at q = 1 it is the expected size (no change, not a bug there); at
    q = 0.005 the divisor check reads each step's count, while the epsilon bound stays near 0 at m = 1,000."""
    s = setup("uls", 2.0, SMALL_Q)
    bad, honest = audited("divide_by_realised_size", s), audited("honest", s)
    assert bad["noise_check_failed"] and not honest["noise_check_failed"]
    assert bad["divisor_ratio_max"] / bad["divisor_ratio_min"] > 2  # q N = 2.5 vs realised 1, 2, 3, ...
    assert honest["divisor_ratio_max"] / honest["divisor_ratio_min"] < 1.2
    full = setup("uls", 2.0, FULL_BATCH)
    same = audited("divide_by_realised_size", full)  # q = 1: the realised size is N, the expected one too
    assert not same["noise_check_failed"]
    assert same["epsilon_lower_bound"] == audited("honest", full)["epsilon_lower_bound"]


# (e) two processes: every rank adds noise of std sigma C / 2 from its own stream (sum: sigma C / sqrt 2)

TWO_PROCESS = dict(FULL_BATCH, canaries=400, physical_batch_size=64)


def _two_process_worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=mm.WORLD)
    try:
        from userdp.training import distributed

        ctx = distributed.current_context()
        out = {}
        for name in ("honest", "noise_on_every_rank"):
            with mm.MUTATIONS[name]():
                out[name] = ma.audit_cell(setup("uls", 2.0, TWO_PROCESS, processes=2), dist=ctx)
        if rank == 0:
            torch.save(out, f"{root}/rows.pt")
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.integration
def test_two_processes_audit_the_same_mechanism_and_see_noise_on_every_rank(tmp_path):
    mp.spawn(_two_process_worker, args=(str(tmp_path),), nprocs=mm.WORLD, join=True)
    rows = torch.load(tmp_path / "rows.pt", weights_only=False)
    one = audited("honest", setup("uls", 2.0, TWO_PROCESS))
    two = rows["honest"]
    # the same mechanism: claim, noise, bound and the exact checks of one process
    for k in ("epsilon_claimed", "noise_multiplier", "epsilon_lower_bound", "best_correct"):
        assert two[k] == pytest.approx(one[k], rel=1e-9), k
    assert two["noise_std_ratio"] == pytest.approx(one["noise_std_ratio"], rel=1e-4)
    bad = rows["noise_on_every_rank"]
    assert bad["noise_check_failed"] and not two["noise_check_failed"]
    assert bad["noise_std_ratio"] == pytest.approx(1 / math.sqrt(2), rel=0.04)
    assert bad["epsilon_lower_bound"] >= two["epsilon_lower_bound"]


# ---------------------------------------------------------------- the honest mechanism and the estimator


@pytest.mark.integration
@pytest.mark.parametrize("method", ["els", "uls"])
def test_honest_mechanism_never_exceeds_its_claim_over_seeds(method):
    """10 audit seeds (coins, noise, sampling) per method, claimed 2 at 400 canaries: every bound below."""
    for seed in range(10):
        r = audited("honest", setup(method, 2.0, dict(FULL_BATCH, canaries=400), seed=seed))
        assert not r["bound_exceeds_claim"], (seed, r)
        assert r["epsilon_lower_bound"] <= r["epsilon_claimed"]
        assert not r["noise_check_failed"] and r["canaries_clipped"] == 1.0
        assert r["epsilon_ledger"] == pytest.approx(r["epsilon_claimed"], rel=1e-9)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at delta of the Gaussian mechanism with sensitivity / sigma = mu (Balle and Wang 2018)."""
    f = lambda e: stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta  # noqa: E731
    return optimize.brentq(f, 0.0, 200.0)


@pytest.mark.integration
@pytest.mark.parametrize("mu", [0.3, 0.5, 0.8])  # epsilon 1.29, 2.25, 3.80: below the ceiling (4.5)
def test_estimator_never_exceeds_the_true_epsilon_of_a_simulated_gaussian_mechanism(mu):
    """T = 1, q = 1: each canary's release is N(mu, 1) or N(0, 1), exactly mu-GDP; 100 seeds at 1,000 canaries.
    The same audit on a mechanism with a quarter of that noise exceeds the epsilon (the test can fail)."""
    delta = 1e-6
    eps = gaussian_epsilon(mu, delta)
    s = ma.CellSetup("uls", eps, 1000, 1, 1.0, 1, delta, 1.0, guess_fractions=(0.02, 0.05, 0.1, 0.2, 0.5))
    bounds = []
    for seed in range(100):
        scores, inc = ma.simulate_scores(s, 1 / mu, np.random.default_rng(seed))
        bounds.append(ma.audit_bound(scores, inc, delta=delta, confidence=0.95,
                                     guess_fractions=s.guess_fractions)["epsilon_lower_bound"])
    assert max(bounds) <= eps, (max(bounds), eps)
    assert np.mean(bounds) > 0.1 * eps  # and it does measure something
    # the f-DP (Gaussian) bound, valid here (each canary's release is exactly N(mu, 1) or N(0, 1)): never above
    # either, and tighter than the (epsilon, delta) bound
    fdp = []
    for seed in range(100):
        scores, inc = ma.simulate_scores(s, 1 / mu, np.random.default_rng(seed))
        fdp.append(ma.audit_bound(scores, inc, delta=delta, confidence=0.95, guess_fractions=s.guess_fractions,
                                  gaussian=True)["epsilon_lower_bound_fdp"])
    assert max(fdp) <= eps, (max(fdp), eps)
    assert np.mean(fdp) > np.mean(bounds)
    scores, inc = ma.simulate_scores(s, 1 / mu, np.random.default_rng(0), noise_scale=0.25)
    assert ma.audit_bound(scores, inc, delta=delta, confidence=0.95,
                          guess_fractions=s.guess_fractions)["epsilon_lower_bound"] > eps


@pytest.mark.integration
def test_calibration_matches_a_known_gaussian():
    """q = 1, G = 1, T = 1 is the Gaussian mechanism: the project's calibration gives sigma = 1/mu of its epsilon."""
    delta, mu = 1e-6, 0.8
    s = ma.CellSetup("uls", gaussian_epsilon(mu, delta), 10, 1, 1.0, 1, delta, 1.0)
    c = ma.calibrate_cell(s)
    assert c["noise_multiplier"] == pytest.approx(1 / mu, rel=2e-3)
    assert c["epsilon_claimed"] <= s.epsilon * (1 + 1e-9)


# ---------------------------------------------------------------- scores, cells, table (fast)


def test_count_aware_score_is_the_exact_likelihood_ratio_on_a_tiny_case():
    """Three canaries, ULS, one step, known count: the score equals the brute-force ratio over every coin/sample."""
    import itertools

    rng = np.random.default_rng(1)
    y = rng.normal(0.5, 1.0, size=(3, 1))
    q, sigma = 0.4, 1.3
    k, pk = np.array([0.0, 1.0]), np.array([1 - q, q])
    other = stats.binom.pmf(np.arange(6), 2, q)  # two other users
    n = 2
    got = ma.count_aware_scores(y, [n], np.ones(3), k, pk, sigma, other, max_count=5)

    def lik(i_in: bool, i: int) -> float:
        total = 0.0
        for coins in itertools.product([0, 1], repeat=3):
            if coins[i] != int(i_in):
                continue
            p_coins = 0.5 ** 2
            for s_ in itertools.product([0, 1], repeat=3):
                if any(s_[j] and not coins[j] for j in range(3)):
                    continue
                p = p_coins * np.prod([(q if s_[j] else 1 - q) if coins[j] else 1.0 for j in range(3)])
                dens = np.prod([stats.norm.pdf(y[j, 0], s_[j], sigma) for j in range(3)])
                rest = n - sum(s_)
                total += p * dens * (other[rest] if rest >= 0 else 0.0)
        return total

    want = [math.log(lik(True, i) / lik(False, i)) for i in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_count_aware_score_without_usable_counts_is_the_likelihood_ratio():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(5, 3))
    k, pk = np.array([0.0, 1.0]), np.array([0.5, 0.5])
    lr = ma.likelihood_ratio_scores(y, np.ones(5), k, pk, 1.0)
    np.testing.assert_allclose(ma.count_aware_scores(y, [None, 500, None], np.ones(5), k, pk, 1.0, [1.0]), lr)


def test_likelihood_ratio_score_of_one_step_is_the_gaussian_mixture_ratio():
    y = np.array([[0.3], [-1.0]])
    q, sigma = 0.25, 2.0
    got = ma.likelihood_ratio_scores(y, np.array([1.0, 0.5]), np.array([0.0, 1.0]), np.array([1 - q, q]), sigma)
    want = [math.log((1 - q) + q * stats.norm.pdf(v, a, sigma) / stats.norm.pdf(v, 0, sigma))
            for v, a in ((0.3, 1.0), (-1.0, 0.5))]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_ceiling_before_training_is_the_audits_ceiling():
    rng = np.random.default_rng(0)
    inc = rng.random(300) < 0.5
    scores = {name: rng.normal(size=300) for name in ma.SCORES}
    fr = (0.05, 0.1, 0.5)
    got = ma.audit_bound(scores, inc, delta=1e-6, confidence=0.95, guess_fractions=fr)
    assert got["epsilon_lower_bound_ceiling"] == ma.bound_ceiling(300, 1e-6, 0.95, fr)
    assert got["guess_sets"] == len(ma.SCORES) * 6  # r = 15, 30, 150: the r highest "in", or r/2 "in" and r/2 "out"
    perfect = {name: inc.astype(float) for name in ma.SCORES}
    assert ma.audit_bound(perfect, inc, delta=1e-6, confidence=0.95,
                          guess_fractions=fr)["epsilon_lower_bound"] == got["epsilon_lower_bound_ceiling"]
    # with the f-DP bound (q = 1): twice the tests, both ceilings as `ceilings` says, each reached by perfect guesses
    both = ma.audit_bound(perfect, inc, delta=1e-6, confidence=0.95, guess_fractions=fr, gaussian=True)
    assert both["guess_sets"] == 2 * got["guess_sets"]
    expected = ma.ceilings(300, 1e-6, 0.95, fr, gaussian=True)
    assert both["epsilon_lower_bound_ceiling"] == expected["epsilon_lower_bound_ceiling"] < got["epsilon_lower_bound_ceiling"]
    assert both["epsilon_lower_bound_fdp"] == expected["epsilon_lower_bound_fdp_ceiling"] > expected["epsilon_lower_bound_ceiling"]
    assert ma.bound_ceiling(300, 1e-6, 0.95, fr, gaussian=True) == expected["epsilon_lower_bound_fdp_ceiling"]


def _params(**kw) -> dict:
    from userdp.config import validate_config

    cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}}, "audit": {"methods": ["uls"],
                                                                                     "epsilons": [1, 4], **kw}})
    return ma.mechanism_params(cfg)


def test_cells_are_methods_times_epsilons_and_bad_cells_name_the_key():
    params = _params()
    assert [(c.method, c.epsilon) for c in ma.select_cells(params)] == [("uls", 1.0), ("uls", 4.0)]
    assert [(c.method, c.epsilon) for c in ma.select_cells(params, "uls", 4)] == [("uls", 4.0)]
    with pytest.raises(ConfigError, match=r"audit\.methods"):
        ma.select_cells(params, "els")
    with pytest.raises(ConfigError, match=r"epsilon 2 is not audited.*audit\.epsilons"):
        ma.select_cells(params, None, 2.0)
    c = ma.select_cells(params)[0]
    assert (c.canaries, c.steps, c.sampling_rate, c.delta) == (1000, 4, 1.0, 1e-6)  # the schema's defaults


def test_config_keys_reach_the_cells():
    params = _params(mechanism={"canaries": 64, "steps": 3, "sampling_rate": 0.5, "processes": 2})
    c = ma.select_cells(params)[0]
    assert (c.canaries, c.steps, c.sampling_rate, c.processes) == (64, 3, 0.5, 2)


def test_adaptive_clipping_reaches_the_cells_only_when_configured():
    from userdp.config import validate_config

    assert "adaptive" not in _params() and ma.select_cells(_params())[0].adaptive is None
    cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}},
                           "privacy": {"clipping": "adaptive", "adaptive": {"count_noise": 0.5}},
                           "audit": {"methods": ["uls"], "epsilons": [1]}})
    c = ma.select_cells(ma.mechanism_params(cfg))[0]
    assert c.clipping == "adaptive" and c.adaptive == AdaptiveClipping(0.5, 0.2, 0.5)
    assert c.adaptive.count_noise == 0.5
    with pytest.raises(ValueError, match="exactly when clipping is 'adaptive'"):
        ma.CellSetup(method="uls", epsilon=1.0, canaries=4, group_size=1, sampling_rate=1.0, steps=1, delta=1e-6,
                     clip_norm=1.0, adaptive=AdaptiveClipping(0.5, 0.2, 0.5))


def test_count_check_passes_the_accounted_noise_and_fails_a_dropped_halved_or_shifted_one():
    rng = np.random.default_rng(0)
    counts = rng.integers(-5, 5, size=400).astype(float)
    noise = rng.normal(0.0, 2.0, size=400)

    def check(released):
        return ma.count_checks({"released_counts": released, "recomputed_counts": counts, "count_noise_std": 2.0})

    honest = check(counts + noise)
    assert not honest["count_check_failed"] and honest["count_noise_ratio"] == pytest.approx(1.0, abs=0.1)
    assert check(counts)["count_check_failed"] and check(counts)["count_noise_ratio"] == 0.0
    assert check(counts + 0.5 * noise)["count_check_failed"]
    assert check(counts + noise + 1.0)["count_check_failed"]  # a count off by one unit's 1/2 twice over


#: Adaptive clipping: small q and 400 steps (C_t crosses the canaries' norms; 400 residuals for the count check),
#: other users whose norms the audit recomputes by brute force. count_noise 0.5: sigma_b = 1.24 at q N = 2.48.
ADAPTIVE = dict(SMALL_Q, other_users=50)
ADAPTIVE_KW = dict(clipping="adaptive", adaptive=AdaptiveClipping(0.5, 0.2, 0.5))


@pytest.mark.integration
@pytest.mark.parametrize("method", ["els", "uls"])
def test_adaptive_clipping_stays_within_its_claim_and_its_count_is_the_accounted_one(method):
    """The honest adaptive mechanism over 2 seeds: no bound above the claim, the gradient's noise sigma_g C_t and
    the count's sigma_b as accounted, the ledger's epsilon the claim; C_t moved across the canaries' norms."""
    for seed in range(2):
        r = audited("honest", setup(method, 2.0, ADAPTIVE, seed=seed, **ADAPTIVE_KW))
        assert not r["bound_exceeds_claim"] and r["epsilon_lower_bound"] <= r["epsilon_claimed"], (seed, r)
        assert not r["noise_check_failed"] and not r["count_check_failed"], (seed, r)
        assert r["count_noise_ratio"] == pytest.approx(1.0, abs=0.15)
        assert r["noise_std_ratio"] == pytest.approx(1.0, abs=0.05)
        assert 0.0 < r["canaries_clipped"] < 1.0
        assert r["epsilon_ledger"] == pytest.approx(r["epsilon_claimed"], rel=1e-9)


@pytest.mark.integration
@pytest.mark.parametrize("mutation,ratio", [("count_noise_dropped", 0.0), ("count_noise_halved", 0.5)])
def test_a_count_without_its_noise_fails_the_count_check(mutation, ratio):
    """(h), (i): the count released without its noise, or with half of it. The epsilon bound cannot see it (the
    count is one number shared by every canary, like the realised batch size of (f)); the exact check does."""
    s = setup("uls", 2.0, ADAPTIVE, **ADAPTIVE_KW)
    bad = audited(mutation, s)
    assert bad["count_check_failed"] and bad["noise_check_failed"], bad
    assert bad["count_noise_ratio"] == pytest.approx(ratio, abs=0.1)
    assert bad["noise_std_ratio"] == pytest.approx(1.0, abs=0.05)  # the gradient's noise is untouched


def test_table_has_the_acceptance_columns_first(tmp_path):
    import pandas as pd

    row = {k: 1 for k in ma.COLUMNS} | {"extra": 2}
    ma.write_table([row], tmp_path / "m.csv")
    df = pd.read_csv(tmp_path / "m.csv")
    assert list(df.columns)[:len(ma.COLUMNS)] == list(ma.COLUMNS) and "extra" in df.columns
    for col in ("method", "epsilon_claimed", "epsilon_lower_bound", "epsilon_lower_bound_ceiling", "canaries"):
        assert col in df.columns


def test_canary_gradient_is_one_row_of_the_embedding_and_above_the_clip_norm():
    """The canary design: only wte trains, canary i's loss reaches only row v_i, and its norm is far above C."""
    s = ma.CellSetup("uls", 1.0, 6, 2, 1.0, 1, 1e-6, 1e-3, other_users=2)
    model = ma.canary_model(s)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["transformer.wte.weight"]
    wte = model.transformer.wte.weight
    ids = torch.full((1, s.example_length), int(s.canary_token(3)))
    from userdp.training.clipping import row_losses

    loss, _ = row_losses(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids, torch.ones_like(ids))
    (g,) = torch.autograd.grad(loss.sum(), [wte])
    nonzero = torch.nonzero(g.abs().sum(1)).flatten().tolist()
    assert nonzero == [int(s.canary_token(3))]
    grads = ma.canary_gradients(model, s)
    np.testing.assert_allclose(grads[3], g[int(s.canary_token(3))].numpy(), rtol=1e-5, atol=1e-7)
    assert np.linalg.norm(grads, axis=1).min() > 100 * s.clip_norm



def test_an_audit_that_cannot_exceed_the_claim_says_so_before_training(caplog, monkeypatch):
    params = _params(epsilons=[8], mechanism={"canaries": 50})
    monkeypatch.setattr(ma, "audit_cell", lambda *a, **k: pytest.fail("trained"))  # the warning comes first
    with caplog.at_level("WARNING"), pytest.raises(pytest.fail.Exception, match="trained"):
        ma.run_audit(params)
    assert "cannot show a bound above the claim" in caplog.text and "50 canaries" in caplog.text


# ---------------------------------------------------------------- banded DP-FTRL (privacy.correlated_noise)


def test_banded_blocks_read_each_participation_as_one_gaussian():
    """A canary of partition p takes part at steps p, p + b, ...; whitened and projected on c, each participation is
    k a ||c|| + N(0, sigma^2), nothing of its other participations (they are b apart)."""
    from userdp.privacy.banded import bsr_coefficients, strategy_matrix

    rng = np.random.default_rng(0)
    b, T, m, sigma = 3, 10, 4000, 0.7
    c = bsr_coefficients(b)
    inv = np.linalg.inv(strategy_matrix(c, T))
    parts = rng.integers(0, b, size=m)
    k = np.zeros((m, T))
    for t in range(T):
        k[:, t] = (parts == t % b) & (rng.random(m) < 0.5)
    amp = np.full((m, T), 0.8)
    y = k * amp + sigma * rng.normal(size=(m, T)) @ inv.T
    Y, A = ma.banded_blocks(y, amp, parts, c)
    assert Y.shape == (m, 4) and np.all(A[parts == 2, 3] == 0)  # partition 2 takes part 3 times in 10 steps
    for j in range(3):
        taken = k[np.arange(m), parts + j * b] == 1
        resid = Y[:, j] - taken * A[:, j]
        assert abs(resid.std() / sigma - 1) < 0.05 and abs(resid.mean()) < 0.05
    assert A[parts == 0, 3] == pytest.approx(0.8 * c[0])  # the last participation (step 9) reaches one row only


def test_correlation_check_passes_c_inverse_z_and_fails_independent_or_unnormalised_noise():
    from userdp.privacy.banded import bsr_coefficients, strategy_matrix

    rng = np.random.default_rng(1)
    s = ma.CellSetup(method="uls", epsilon=2.0, canaries=4, group_size=1, sampling_rate=1.0, steps=40, delta=1e-6,
                     clip_norm=1.0, bands=4)
    inv = np.linalg.inv(strategy_matrix(bsr_coefficients(4), 40))
    z = rng.normal(size=(8, 40, 16))
    honest = ma.correlation_checks(s, np.einsum("ts,fsd->ftd", inv, z))
    assert not honest["correlation_check_failed"] and honest["whitened_std_ratio"] == pytest.approx(1.0, abs=0.05)
    assert ma.correlation_checks(s, z)["correlation_check_failed"]  # independent noise whitens to C z
    assert ma.correlation_checks(s, np.einsum("ts,fsd->ftd", inv, z) / 1.25)["whitened_std_ratio"] \
        == pytest.approx(0.8, abs=0.05)
    with pytest.raises(ValueError, match="ULS only"):
        ma.CellSetup(method="els", epsilon=2.0, canaries=4, group_size=1, sampling_rate=1.0, steps=4, delta=1e-6,
                     clip_norm=1.0, bands=2)


def test_bands_reach_the_uls_cells_only_when_configured():
    from userdp.config import validate_config

    assert "bands" not in _params() and ma.select_cells(_params())[0].bands == 1
    cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}},
                           "privacy": {"correlated_noise": {"bands": 4}},
                           "audit": {"methods": ["els", "uls"], "epsilons": [1]}})
    cells = {c.method: c for c in ma.select_cells(ma.mechanism_params(cfg))}
    assert cells["uls"].bands == 4 and cells["els"].bands == 1


#: Banded DP-FTRL: q = 1 within the partition, 16 steps of b = 4 (4 participations per canary), f-DP bound.
BANDED = dict(FULL_BATCH, group_size=1, steps=16, other_users=0, bands=4)


@pytest.mark.integration
def test_banded_dp_ftrl_stays_within_its_claim_and_its_noise_is_c_inverse_z():
    """The honest banded mechanism over 2 seeds: no bound above the claim, the whitened noise i.i.d. at the
    accounted std, the ledger's epsilon the claim."""
    for seed in range(2):
        r = audited("honest", setup("uls", 2.0, BANDED, seed=seed))
        assert not r["bound_exceeds_claim"] and r["epsilon_lower_bound_fdp"] <= r["epsilon_claimed"], (seed, r)
        assert not r["noise_check_failed"] and not r["correlation_check_failed"], (seed, r)
        assert r["noise_std_ratio"] == pytest.approx(1.0, abs=0.05) and r["bands"] == 4
        assert r["epsilon_ledger"] == pytest.approx(r["epsilon_claimed"], rel=1e-9)


@pytest.mark.integration
@pytest.mark.parametrize("mutation", ["correlation_dropped", "band_coefficients_unnormalised"])
def test_banded_noise_without_its_correlation_or_with_wrong_bands_fails_the_noise_check(mutation):
    """(j) independent noise instead of C^-1 z (whitened: correlated at lag 1 by sum c_k c_k+1); (k) the strategy's
    columns at norm 1.25, i.e. 1 / 1.25 of the accounted noise."""
    bad = audited(mutation, setup("uls", 2.0, BANDED))
    assert bad["noise_check_failed"], bad
    if mutation == "correlation_dropped":
        assert bad["correlation_check_failed"] and bad["noise_correlation"] > 20
    else:
        assert bad["noise_std_ratio"] == pytest.approx(1 / mm.UNNORMALISED, abs=0.03)


@pytest.mark.integration
def test_banded_sampling_without_its_cycle_is_caught_by_the_bound():
    """(l) every user sampled at every step instead of once per b = 4 steps (16 participations of a canary where
    the accountant assumes 4): the noise is right, the f-DP bound is not (3.05 against the claim 2 at seed 0;
    2.69-3.05 over seeds 0-3; the honest mechanism 0.62)."""
    bad = audited("cyclic_sampling_broken", setup("uls", 2.0, BANDED))
    honest = audited("honest", setup("uls", 2.0, BANDED))
    assert bad["bound_exceeds_claim"] and bad["epsilon_lower_bound_fdp"] > bad["epsilon_claimed"], bad
    assert not honest["bound_exceeds_claim"], honest
    assert not bad["noise_check_failed"]  # the bug is in the sampling, which only the bound sees


def test_a_failed_correlation_check_fails_the_noise_check_also_with_adaptive_clipping():
    """With clipping adaptive AND banded noise, the count check must add to the correlation check, not replace it:
    independent noise at the right per-step std (only the correlation is wrong) fails the noise check."""
    from userdp.privacy.banded import bsr_coefficients, marginal_std_factors

    rng = np.random.default_rng(3)
    T = 40
    s = ma.CellSetup(method="uls", epsilon=2.0, canaries=4, group_size=1, sampling_rate=1.0, steps=T, delta=1e-6,
                     clip_norm=1.0, bands=4, clipping="adaptive", adaptive=AdaptiveClipping(0.5, 0.2, 0.5))
    rows = marginal_std_factors(bsr_coefficients(4), T)
    counts = rng.integers(-5, 5, size=T).astype(float)
    run = {"free": rng.normal(size=(8, T, 16)) * rows[None, :, None], "divisor": 1.0,
           "released": np.zeros((4, T, 16)),
           "adaptive": {"clip_norms": np.ones(T), "released_counts": counts + rng.normal(size=T),
                        "recomputed_counts": counts, "gradient_noise_multiplier": 1.0, "count_noise_std": 1.0}}
    out = ma.noise_checks(s, 1.0, run)
    assert out["correlation_check_failed"] and not out["count_check_failed"]
    assert out["noise_check_failed"]
