"""userdp.privacy.pld_arrays gives dp-accounting's PMFs and epsilons bit for bit, on the PLDs the pipeline builds
and on constructed edge cases (the loop's early returns, infinite mass, underflowing terms)."""

import math

import numpy as np
import pytest
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

from userdp.privacy import accounting as A
from userdp.privacy import pld_arrays

DELTAS = (1e-12, 1e-9, 1e-6, 8.53e-5, 1e-3, 0.05, 0.5, 0.999)


def _library_pmf(loss, d):
    return pld_lib._create_pld_pmf_from_monotone_privacy_loss(
        loss, pessimistic_estimate=True, value_discretization_interval=d, use_connect_dots=True)


def _same_pmf(ours, theirs):
    assert type(ours) is type(theirs)
    assert ours._discretization == theirs._discretization
    assert ours._infinity_mass == theirs._infinity_mass
    if isinstance(theirs, pld_pmf.DensePLDPmf):
        assert ours._lower_loss == theirs._lower_loss
        assert ours._probs.dtype == theirs._probs.dtype
        assert np.array_equal(ours._probs, theirs._probs)
    else:
        assert ours._loss_probs == theirs._loss_probs


@pytest.mark.parametrize("sigma,sens,probs,d", [
    (0.9, [0.0, 1.0], [0.96, 0.04], 1e-3),  # ULS step (Poisson-subsampled Gaussian)
    (0.62, [0.0, 1.0], [0.9975, 0.0025], 1e-4),
    (2.5, [0.0, 1.0, 2.0, 3.0], [0.7, 0.2, 0.07, 0.03], 1e-4),  # ELS step (MoG)
    (8.0, [0.0, 1.0], [0.5, 0.5], 1e-2),  # a grid under the sparse limit: dp-accounting's own path
])
def test_connect_dots_pmf_is_dp_accountings(sigma, sens, probs, d):
    for loss in A._mog_losses(sigma, sens, probs):
        _same_pmf(pld_arrays.connect_dots_pmf(loss, d), _library_pmf(loss, d))


def test_connect_dots_pmf_of_dp_accountings_gaussian_and_laplace():
    for loss in (plm.GaussianPrivacyLoss(1.3, sampling_prob=0.1), plm.GaussianPrivacyLoss(0.7),
                 plm.LaplacePrivacyLoss(1.5), plm.DiscreteLaplacePrivacyLoss(0.8)):
        _same_pmf(pld_arrays.connect_dots_pmf(loss, 1e-4), _library_pmf(loss, 1e-4))


def test_dense_connect_dots_refuses_what_dp_accounting_refuses():
    increasing = np.linspace(0.1, 0.2, 2000)
    with pytest.raises(ValueError, match="non-increasing"):
        pld_arrays._dense_connect_dots(1e-3, 0, 1999, increasing)
    with pytest.raises(ValueError, match="between 0 and 1"):
        pld_arrays._dense_connect_dots(1e-3, 0, 1999, np.linspace(1.5, 0.0, 2000))


def _composed(sigma, sens, probs, steps, d=1e-4):
    return A._compose(A.mixture_gaussian_pld(sigma, sens, probs, d), steps, d, "test")


def test_epsilon_for_delta_is_dp_accountings_on_composed_plds():
    plds = [_composed(0.62, [0.0, 1.0], [0.9975, 0.0025], 50),
            _composed(0.94, [0.0, 1.0], [0.96, 0.04], 50),
            _composed(2.5, [0.0, 1.0, 2.0, 3.0], [0.7, 0.2, 0.07, 0.03], 20, 1e-3),
            _composed(30.0, [0.0, 1.0], [0.5, 0.5], 3, 1e-3)]
    checked = 0
    for pld in plds:
        for delta in DELTAS:
            theirs = pld.get_epsilon_for_delta(delta)
            ours = pld_arrays.epsilon_for_delta(pld, delta)
            assert ours == theirs, delta
            checked += math.isfinite(theirs) and theirs > 0
    assert checked > 20  # most cases stop inside the grid, not at an early return


def _dense(lower_loss, probs, infinity_mass, d=1e-2):
    return pld_pmf.DensePLDPmf(d, lower_loss, np.asarray(probs, dtype=float), infinity_mass, True)


def test_epsilon_for_delta_early_returns_and_edges():
    rng = np.random.default_rng(5)
    pmfs = [
        _dense(-50, rng.dirichlet(np.ones(400)), 0.0),
        _dense(-50, rng.dirichlet(np.ones(400)) * 0.9, 0.1),  # infinity mass above small deltas: inf
        _dense(80_000, [0.3, 0.7], 0.0, 1e-2),  # losses of 800: exp(-loss) underflows to 0 (the early max(0, loss))
        _dense(-80_000, [0.2, 0.8], 0.0, 1e-2),  # all losses negative
        _dense(-3, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0], 0.0),  # zeros around the mass
        _dense(10, rng.dirichlet(np.ones(2000)) ** 3, 1e-7, 1e-3),
    ]
    raised, outcomes = set(), set()
    for pmf in pmfs:
        for delta in DELTAS + (0.0,):
            try:
                theirs = pmf.get_epsilon_for_delta(delta)
            except (ZeroDivisionError, OverflowError) as exc:  # its loop divides by 0 or overflows exp: so do we
                with pytest.raises(type(exc)):
                    pld_arrays._pmf_epsilon(pmf, delta)
                raised.add(type(exc))
                continue
            assert pld_arrays._pmf_epsilon(pmf, delta) == theirs, (pmf._lower_loss, delta)
            outcomes.add("inf" if theirs == math.inf else "zero" if theirs == 0 else "finite")
    assert raised == {OverflowError} and outcomes == {"inf", "zero", "finite"}


def test_epsilon_for_delta_leaves_sparse_and_tiny_pmfs_to_dp_accounting():
    sparse = pld_pmf.SparsePLDPmf({3: 0.5, 40: 0.5}, 1e-2, 1e-9, True)
    tiny = _dense(5, [1.0], 0.0)
    pld = pld_lib.PrivacyLossDistribution(sparse, tiny)
    for delta in DELTAS:
        assert pld_arrays.epsilon_for_delta(pld, delta) == pld.get_epsilon_for_delta(delta)


def test_mog_get_delta_for_epsilon_arrays_of_any_size_are_dp_accountings():
    """The block version (no Python fix-up loop) serves every array (scalars keep dp-accounting's path)."""
    for loss in A._mog_losses(1.1, [0.0, 1.0, 2.0], [0.8, 0.15, 0.05]):
        for grid in (np.linspace(-0.5, 6.0, 7), np.linspace(-2.0, 9.0, 5001)):
            ours = loss.get_delta_for_epsilon(grid)
            theirs = plm.MixtureGaussianPrivacyLoss.get_delta_for_epsilon(loss, grid)
            assert np.array_equal(ours, theirs)


def test_epsilon_for_delta_reads_the_add_pmf_where_it_is_the_larger():
    """dp-accounting takes the larger of the remove and add epsilons: a PLD whose add side dominates."""
    small = _dense(-40, np.random.default_rng(1).dirichlet(np.ones(300)), 0.0)
    large = _dense(-10, np.random.default_rng(2).dirichlet(np.ones(3000)), 0.0)
    pld = pld_lib.PrivacyLossDistribution(small, large)
    for delta in DELTAS:
        theirs = pld.get_epsilon_for_delta(delta)
        assert pld_arrays.epsilon_for_delta(pld, delta) == theirs
    assert pld_arrays._pmf_epsilon(large, 1e-3) > pld_arrays._pmf_epsilon(small, 1e-3)


def test_epsilon_for_delta_numeric_edges_are_dp_accountings():
    pmf = _dense(-200, np.random.default_rng(3).dirichlet(np.ones(600)), 1e-7)
    for delta in (np.float32(1e-3), np.float64(1e-3), 1e-3, np.float32(0.05)):  # numpy 2 promotion: float64
        assert pld_arrays._pmf_epsilon(pmf, delta) == pmf.get_epsilon_for_delta(delta)
    # the running ratio underflows to 0: dp-accounting's math.log raises, and so does ours
    tiny = _dense(-70900, [0.5, 0.5], 0.0)
    with pytest.raises(ValueError):
        tiny.get_epsilon_for_delta(0.5 - 2 ** -54)
    with pytest.raises(ValueError):
        pld_arrays._pmf_epsilon(tiny, 0.5 - 2 ** -54)
    # a NaN delta gives NaN in both
    under = _dense(80_000, [0.3, 0.7], 0.0)
    with np.errstate(all="ignore"):
        assert math.isnan(under.get_epsilon_for_delta(float("nan")))
        assert math.isnan(pld_arrays._pmf_epsilon(under, float("nan")))


@pytest.mark.parametrize("points", [999, 1000, 1001])
def test_connect_dots_pmf_at_the_sparse_limit(points):
    """Grids of 1000 points are sparse in dp-accounting, 1001 dense: the same on both sides of the limit."""
    loss = A._mog_losses(1.3, [0.0, 1.0], [0.9, 0.1])[0]
    b = loss.connect_dots_bounds()
    lower, upper = math.floor(b.epsilon_lower / 1e-3), math.ceil(b.epsilon_upper / 1e-3)
    d = (b.epsilon_upper - b.epsilon_lower) / (points - 1.5)  # about `points` grid points
    for dd in (d * 0.999, d, d * 1.001):
        n = math.ceil(b.epsilon_upper / dd) - math.floor(b.epsilon_lower / dd) + 1
        if n == points:
            _same_pmf(pld_arrays.connect_dots_pmf(loss, dd), _library_pmf(loss, dd))
            return
    assert lower < upper
    pytest.skip(f"no discretization near {d:g} gives exactly {points} points")


def test_dense_connect_dots_takes_rises_within_dp_accountings_tolerance():
    deltas = np.linspace(0.5, 0.0, 2000)
    deltas[700] = deltas[699] + 5e-13  # a rise below dp-accounting's 1e-12 tolerance: accepted, then flattened
    ours = pld_arrays._dense_connect_dots(1e-3, -1000, 999, deltas)
    theirs = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(1e-3, -1000, 999, deltas)
    _same_pmf(ours, theirs)


def test_mog_get_delta_for_epsilon_with_an_infinite_epsilon_is_dp_accountings():
    for loss in A._mog_losses(1.1, [0.0, 1.0, 2.0], [0.8, 0.15, 0.05]):
        grid = np.array([0.5, 1.0, np.inf])
        with np.errstate(all="ignore"):
            ours = loss.get_delta_for_epsilon(grid)
            theirs = plm.MixtureGaussianPrivacyLoss.get_delta_for_epsilon(loss, grid)
        assert np.array_equal(ours, theirs, equal_nan=True)
        assert not np.isnan(ours[0])
