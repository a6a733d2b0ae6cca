"""The accountants against dp-accounting events built here, and their properties."""

import math

import numpy as np
import pytest
from scipy import stats

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from userdp.errors import AccountingLimitError, PrivacyError
from userdp.privacy import _dp_accounting_compat as compat
from userdp.privacy import accounting as A

from privacy_helpers import epsilon_of


def reference_epsilon(event, delta, d):
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=d)
    acc.compose(event)
    return acc.get_epsilon(delta)


def mog_event(sigma, q, T, G):
    """The ELS mechanism written out independently of userdp."""
    k = np.arange(G + 1)
    p = stats.binom.pmf(k, G, q)
    step = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(sigma, [float(x) for x in k], [float(x) for x in p])
    return dp_accounting.SelfComposedDpEvent(step, T)


def poisson_event(sigma, q, T):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), T
    )


@pytest.mark.parametrize(
    "sigma,q,T,G",
    [pytest.param(1.0, 0.01, 100, 1, marks=pytest.mark.integration),
     pytest.param(1.5, 0.02, 50, 3, marks=pytest.mark.integration),
     pytest.param(4.0, 0.05, 20, 8, marks=pytest.mark.integration),
     pytest.param(0.8, 0.001, 200, 5, marks=pytest.mark.integration),
     (12.0, 0.01, 100, 32)],  # the fast lane's case (tests/README.md); the others take 1.5-4 s each
)
def test_els_matches_dp_accounting_mixture_event(sigma, q, T, G):
    d = 1e-3  # the reference is slow at 1e-4; the code path is the same
    ours = epsilon_of("els", sigma, q, T, 1e-6, G, discretization=d)
    ref = reference_epsilon(mog_event(sigma, q, T, G), 1e-6, d)
    assert ours == pytest.approx(ref, rel=1e-6)


@pytest.mark.integration
def test_els_matches_at_fine_discretization():
    ours = epsilon_of("els", 3.0, 0.01, 100, 1e-5, 8)
    ref = reference_epsilon(mog_event(3.0, 0.01, 100, 8), 1e-5, 1e-4)
    assert ours == pytest.approx(ref, rel=1e-7)


@pytest.mark.parametrize("sigma,q,T", [(0.7, 0.01, 100), (1.2, 0.1, 30), (3.0, 0.5, 10)])
def test_uls_matches_poisson_event(sigma, q, T):
    ours = epsilon_of("uls", sigma, q, T, 1e-6, discretization=1e-3)
    ref = reference_epsilon(poisson_event(sigma, q, T), 1e-6, 1e-3)
    assert ours == pytest.approx(ref, rel=1e-6)


@pytest.mark.integration
@pytest.mark.parametrize("sigma,q,T", [(0.9, 0.01, 200), (2.0, 0.2, 20)])
def test_els_with_one_example_per_user_is_the_poisson_subsampled_gaussian(sigma, q, T):
    # Computed by dp-accounting from the two different events.
    mog = reference_epsilon(mog_event(sigma, q, T, 1), 1e-6, 1e-3)
    pois = reference_epsilon(poisson_event(sigma, q, T), 1e-6, 1e-3)
    assert mog == pytest.approx(pois, rel=1e-6)
    assert epsilon_of("els", sigma, q, T, 1e-6, 1, discretization=1e-3) == pytest.approx(pois, rel=1e-6)


def group_factor(G, e):
    """sum_{k<G} e^{k e}: the group-privacy delta factor, written out."""
    return sum(math.exp(k * e) for k in range(G))


def test_group_privacy_conversion_formula():
    # Against a direct scan of the example-level curve.
    sigma, q, T, G, delta = 3.0, 0.01, 100, 4, 1e-6
    d = 1e-3
    pld = A._composed_step_pld(("poisson", sigma, q), T, d)
    grid = np.linspace(0.01, 5, 5000)
    feasible = [e for e in grid if group_factor(G, e) * pld.get_delta_for_epsilon(e) <= delta]
    expected = G * min(feasible)
    got = epsilon_of("group", sigma, q, T, delta, G, discretization=d)
    assert got <= expected + 1e-9
    assert got == pytest.approx(expected, abs=G * (grid[1] - grid[0]))


@pytest.mark.parametrize("G,e", [(1, 0.3), (2, 0.0), (4, 1e-9), (4, 0.5), (64, 3.0), (64, 10.0)])
def test_group_delta_factor(G, e):
    expected = math.log(group_factor(G, e)) if e > 0 else math.log(G)
    assert A.log_group_delta_factor(G, e) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert A.log_group_delta_factor(G, e) <= math.log(G) + (G - 1) * e + 1e-12  # never above Vadhan's G e^{(G-1)e}


def rdp_accountant(sigma, q, T):
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(poisson_event(sigma, q, T))
    return acc


@pytest.mark.parametrize("sigma,q,T,G,delta", [pytest.param(3.0, 0.01, 100, 4, 1e-6, marks=pytest.mark.integration),
                                               (1.2, 0.01, 1000, 4, 1e-6), (8.0, 0.01, 1000, 16, 1e-6)])
def test_rdp_group_privacy_against_a_scan_of_the_rdp_curve(sigma, q, T, G, delta):
    # The baseline of tensorflow_privacy's user-level path: dp-accounting's RDP curve of the example-level
    # mechanism, converted by group privacy; here by a scan of that curve.
    acc = rdp_accountant(sigma, q, T)
    e1 = acc.get_epsilon(delta / G)
    grid = np.linspace(e1, 4 * e1 + 1, 4000)
    feasible = [e for e in grid if group_factor(G, e) * acc.get_delta(e) <= delta]
    expected = G * min(feasible)
    got = epsilon_of("group_rdp", sigma, q, T, delta, G)
    assert got <= expected + 1e-9
    assert got == pytest.approx(expected, abs=G * (grid[1] - grid[0]))


def test_rdp_group_privacy_of_one_example_is_the_rdp_epsilon():
    assert epsilon_of("group_rdp", 1.1, 0.01, 500, 1e-6, 1) == pytest.approx(
        rdp_accountant(1.1, 0.01, 500).get_epsilon(1e-6), rel=1e-12)


@pytest.mark.parametrize("sigma,q,T,G", [(2.0, 0.01, 100, 2), (5.0, 0.02, 50, 8), (1.0, 0.05, 20, 4),
                                         (1.0, 0.01, 1000, 4)])
def test_tight_accountant_never_looser_than_either_group_baseline(sigma, q, T, G):
    tight = epsilon_of("els", sigma, q, T, 1e-6, G, discretization=1e-3)
    for baseline in ("group", "group_rdp"):
        assert tight < epsilon_of(baseline, sigma, q, T, 1e-6, G, discretization=1e-3) * 0.999


def test_pld_group_conversion_has_no_bound_below_a_noise_level_where_rdp_still_has_one():
    # The PLD's truncated tail (a floor on delta_ex) against the factor e^{(G-1) eps_ex}: documented in
    # accounting.group_privacy_epsilon. RDP's delta_ex has no floor.
    assert math.isinf(epsilon_of("group", 0.9, 0.01, 1000, 1e-6, 4))
    assert math.isfinite(epsilon_of("group_rdp", 0.9, 0.01, 1000, 1e-6, 4))


@pytest.mark.integration
def test_epsilon_increases_with_q_T_G_and_decreases_with_sigma():
    base = dict(sigma=2.0, q=0.01, T=100, G=4)

    def eps(sigma, q, T, G):
        return epsilon_of("els", sigma, q, T, 1e-6, G, discretization=1e-3)

    e0 = eps(**base)
    for key, values in {"q": [0.005, 0.01, 0.02, 0.05], "T": [25, 50, 100, 200], "G": [1, 2, 4, 8]}.items():
        seq = [eps(**{**base, key: v}) for v in values]
        assert all(a < b for a, b in zip(seq, seq[1:])), (key, seq)
        assert e0 in seq
    seq = [eps(**{**base, "sigma": s}) for s in [1.0, 1.5, 2.0, 3.0, 6.0]]
    assert all(a > b for a, b in zip(seq, seq[1:])), seq
    useq = [epsilon_of("uls", s, 0.01, 100, 1e-6, discretization=1e-3) for s in [0.8, 1.0, 2.0]]
    assert all(a > b for a, b in zip(useq, useq[1:]))


def test_degenerate_cases():
    assert epsilon_of("els", 0.0, 0.01, 10, 1e-6, 4) == math.inf
    assert epsilon_of("uls", 0.0, 0.01, 10, 1e-6) == math.inf
    assert epsilon_of("els", 1.0, 0.01, 0, 1e-6, 4) == 0.0


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(method="els", noise_multiplier=-1.0), "noise multiplier"),
        (dict(method="els", sampling_rate=0.0), "sampling rate"),
        (dict(method="els", sampling_rate=1.5), "sampling rate"),
        (dict(method="els", delta=1.0), "delta"),
        (dict(method="els", delta=0.0), "delta"),
        (dict(method="els", group_size=0), "group size"),
        (dict(method="dp"), "method"),
    ],
)
def test_invalid_arguments_raise_privacy_error(kwargs, needle):
    args = dict(method="els", noise_multiplier=1.0, sampling_rate=0.01, steps=10, delta=1e-6, group_size=2)
    args.update(kwargs)
    with pytest.raises(PrivacyError, match=needle):
        epsilon_of(**args)


def test_pruned_sensitivities_only_move_mass_up():
    sens, probs = A.pruned_binomial_sensitivities(64, 0.01)
    assert len(sens) < 65 and sens[-1] == 64.0
    assert math.fsum(probs) == pytest.approx(1.0, abs=1e-12)
    full_s, full_p = A.binomial_sensitivities(64, 0.01)
    # Kept components are unchanged; the lumped mass equals the dropped tail.
    k = len(sens) - 1
    assert probs[:k] == full_p[:k]
    assert probs[-1] == pytest.approx(math.fsum(full_p[k:]), rel=1e-6, abs=1e-300)


@pytest.mark.parametrize("k", [1, 2, 7, 8, 9, 15, 16, 17, 33, 64, 127, 128, 129, 140])
def test_logsumexp_across_rows_is_bit_for_bit_the_row_version(k):
    # the bisection of the fast MoG inverse reduces (components x points); it must give exactly the numbers
    # the row-wise version gave (and so the same PLDs, calibrations and plans)
    rng = np.random.default_rng(k)
    z = rng.normal(scale=2.0, size=(3000, k))  # comparable terms: most sums depend on the order of additions
    z[rng.random(z.shape) < 0.05] = -np.inf  # components with zero probability
    z[0] = -np.inf  # a point where every component is impossible (nan either way)
    rows = A._logsumexp_rows(z)
    cols = A._logsumexp_columns(np.ascontiguousarray(z.T))
    assert np.array_equal(rows, cols, equal_nan=True)
    if k <= 128:
        e = np.exp(z[1:])
        assert np.array_equal(A._sum_rows_as_numpy_sums_a_row(np.ascontiguousarray(e.T)), e.sum(axis=1))


def _pmfs_for_bounds():
    rng = np.random.default_rng(7)
    out = [np.array([1.0]), np.array([0.25, 0.75]), np.array([0.0, 1.0, 0.0]), np.array([1e-300, 0.0, 1.0 - 1e-300])]
    for n in (7, 8, 129, 1000, 65537):
        p = rng.random(n) ** 12
        p[: n // 10] = 0.0  # zero weights at both ends and inside: scipy masks them
        p[n - n // 7:] = 0.0
        p[rng.random(n) < 0.05] = 0.0
        if p.sum() == 0:
            p[n // 2] = 1.0
        out.append(p / p.sum())
    pld = A.mixture_gaussian_pld(0.9, [0.0, 1.0, 2.0], [0.8, 0.15, 0.05], 1e-3)
    out += [compat.dense_parts(pmf).probs for pmf in compat.pld_pmfs(pld)]
    return out


def test_self_convolve_bounds_are_dp_accountings():
    """The faster Chernoff bounds give dp-accounting's integers: the same truncation, the same epsilons."""
    from dp_accounting.pld import common as pld_common
    from scipy import special

    for probs in _pmfs_for_bounds():
        index = np.arange(len(probs))
        nonzero = np.flatnonzero(probs)
        for order in A._CHERNOFF_ORDERS / len(probs):
            ours = A._log_mgf(index, probs, nonzero, order)
            theirs = float(special.logsumexp(index * order, b=probs))
            assert ours == theirs, (len(probs), order)
        for steps in (1, 2, 50, 1000):
            for tail in (1e-15, 1e-3, 0.0):
                assert A._self_convolve_bounds(probs, steps, tail) == \
                    pld_common.compute_self_convolve_bounds(probs, steps, tail), (len(probs), steps, tail)
    # inputs outside the fast path (no nonzero entry, negative entries) take dp-accounting's own function
    for probs in (np.zeros(5), np.array([0.5, -0.1, 0.6])):
        assert A._self_convolve_bounds(probs, 10, 1e-15) == pld_common.compute_self_convolve_bounds(probs, 10, 1e-15)


@pytest.mark.parametrize("sigma", [3.1032171316188943, 1.0, 9.55])
def test_els_at_full_batch_is_the_gaussian_mechanism_with_sensitivity_g(sigma):
    """ELS at q = 1: every example of every user in every step, Binomial(G, 1) = G: the Gaussian mechanism
    with sensitivity G. dp-accounting's MoG tail search returned None on this mixture at some sigmas (3.10 at
    G = 4: a TypeError that crashed a run's ledger after training); it is composed as the Gaussian it is."""
    from userdp.privacy import mechanism

    G, T, delta = 4, 4, 1e-6
    ours = A.epsilon(mechanism.ELS(1.0, T, G).dp_event(sigma), delta)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=A.FINE_DISCRETIZATION)
    acc.compose(dp_accounting.GaussianDpEvent(sigma / G), T)
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-6)


@pytest.mark.parametrize("shuffled", [False, True])
def test_mog_inverse_computes_each_midpoint_once_with_the_same_numbers(shuffled):
    """Losses that share a bisection interval share its midpoint's loss: the inverse of many losses at once
    equals each loss's own bisection (a one-element call, where nothing is shared), bit for bit, whatever
    their order (dp-accounting passes them sorted, which shares the most)."""
    from userdp.privacy.accounting import _mog_losses

    rng = np.random.default_rng(3)
    for loss in _mog_losses(0.9, [0, 1, 2, 3, 4], [0.6, 0.2, 0.1, 0.06, 0.04]):
        grid = np.linspace(-3.0, 6.0, 3001)
        if shuffled:
            grid = rng.permutation(grid)
        bracket = (-40.0, 40.0)
        together = np.asarray(loss._inverse_privacy_losses_with_range(grid, bracket))
        alone = np.array([loss._inverse_privacy_losses_with_range(np.array([x]), bracket)[0] for x in grid])
        assert together.shape == grid.shape
        assert np.array_equal(together, alone)
        assert len(np.unique(together)) > 1000  # a real spread of inverses, not one clipped value


# --- the accountant behind dp-accounting's PrivacyAccountant interface ------------------------------------------


def test_user_level_accountant_is_a_dp_accounting_accountant_with_epsilons_bit_identical():
    d = 1e-3
    els, uls = mog_event(2.0, 0.05, 30, 4), poisson_event(1.5, 0.05, 40)
    stats_release = dp_accounting.LaplaceDpEvent(5.0)
    for event in (els, uls, dp_accounting.ComposedDpEvent([uls, stats_release])):
        acc = A.UserLevelAccountant(discretization=d)
        assert isinstance(acc, dp_accounting.PrivacyAccountant) and acc.supports(event)
        acc.compose(event)
        assert acc.get_epsilon(1e-5) == A.epsilon(event, 1e-5, discretization=d)
    # composing twice is the 2-fold composition; the interface's count is a self-composition
    two = A.UserLevelAccountant(discretization=d).compose(uls).compose(uls)
    assert two.get_epsilon(1e-5) == A.UserLevelAccountant(discretization=d).compose(uls, 2).get_epsilon(1e-5) \
        == A.epsilon(dp_accounting.SelfComposedDpEvent(uls, 2), 1e-5, discretization=d)
    assert two.get_epsilon(1e-5) > A.epsilon(uls, 1e-5, discretization=d)
    assert A.UserLevelAccountant().get_epsilon(1e-5) == 0.0  # nothing composed
    # dp-accounting's own record of what was composed, re-accounted, gives the same epsilon
    assert A.epsilon(two.ledger, 1e-5, discretization=d) == two.get_epsilon(1e-5)


def test_user_level_accountant_delta_and_its_refusals():
    d = 1e-3
    event = poisson_event(1.5, 0.05, 40)
    acc = A.UserLevelAccountant(discretization=d).compose(event)
    eps = acc.get_epsilon(1e-5)
    assert 0 < acc.get_delta(eps) <= 1e-5 * (1 + 1e-9)  # the delta at the epsilon reported for 1e-5
    ref = pld_privacy_accountant.PLDAccountant(value_discretization_interval=d)
    ref.compose(event)
    assert acc.get_delta(2.0) == pytest.approx(ref.get_delta(2.0), rel=1e-3)
    # a non-private part: epsilon inf, delta 1
    leaky = A.UserLevelAccountant().compose(dp_accounting.NonPrivateDpEvent())
    assert leaky.get_epsilon(1e-5) == math.inf and leaky.get_delta(10.0) == 1.0
    # a part composed zero times never happens: nothing to account, but it must still be one the accountant knows
    never = dp_accounting.SelfComposedDpEvent(dp_accounting.NonPrivateDpEvent(), 0)
    assert A.epsilon(never, 1e-5) == 0.0 and A.epsilon(dp_accounting.ComposedDpEvent([event, never]), 1e-5,
                                                        discretization=d) == eps
    with pytest.raises(PrivacyError, match="ZCDpEvent"):
        A.epsilon(dp_accounting.SelfComposedDpEvent(dp_accounting.dp_event.ZCDpEvent(0.5), 0), 1e-5)
    # what it cannot account is refused as dp-accounting's accountants refuse it, naming the event
    unsupported = dp_accounting.dp_event.ZCDpEvent(0.5)
    assert not A.UserLevelAccountant().supports(dp_accounting.ComposedDpEvent([event, unsupported]))
    with pytest.raises(dp_accounting.UnsupportedEventError, match="ZCDpEvent"):
        A.UserLevelAccountant().compose(dp_accounting.SelfComposedDpEvent(unsupported, 3))
    with pytest.raises(PrivacyError, match="delta is 0"):
        acc.get_epsilon(0.0)


def test_user_level_accountant_delta_checks_the_composed_size(monkeypatch):
    """get_delta composes the steps with the fixed releases under the same memory bound as get_epsilon."""
    d = 1e-3
    acc = A.UserLevelAccountant(discretization=d).compose(poisson_event(1.5, 0.05, 40)).compose(
        dp_accounting.LaplaceDpEvent(20.0))
    eps = acc.get_epsilon(1e-5)
    assert 0 < acc.get_delta(eps) <= 1e-5 * (1 + 1e-9)
    checked = []
    real = A.check_pld_size
    monkeypatch.setattr(A, "check_pld_size", lambda points, what, disc: (checked.append(what), real(points, what, disc)))
    acc.get_delta(eps)
    assert "the training steps composed with the fixed releases" in checked
    monkeypatch.setattr(A, "MAX_PLD_POINTS", 1)
    with pytest.raises(AccountingLimitError, match="MAX_PLD_POINTS"):
        acc.get_delta(eps)
