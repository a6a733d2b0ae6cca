"""Calibration meets the target and is tight to its tolerance."""

import math

import pytest

from userdp.errors import PrivacyError
from userdp.privacy.calibration import initial_guess

from privacy_helpers import calibrate_method, epsilon_of, mech


@pytest.mark.integration
@pytest.mark.parametrize(
    "method,eps,q,T,G",
    [("els", 1.0, 0.01, 100, 1), ("els", 4.0, 0.01, 200, 8), ("uls", 2.0, 0.02, 100, 1), ("group", 8.0, 0.01, 100, 4)],
)
def test_calibrated_sigma_meets_target_and_is_tight(method, eps, q, T, G):
    delta = 1e-6
    r = calibrate_method(method, eps, delta, q, T, G)
    # Recomputed independently at the fine discretization.
    achieved = epsilon_of(method, r.noise_multiplier, q, T, delta, G)
    assert achieved <= eps
    assert achieved == pytest.approx(r.epsilon_achieved, rel=1e-12)
    assert epsilon_of(method, r.noise_multiplier * (1 - 2e-3), q, T, delta, G) > eps
    assert r.noise_lower < r.noise_multiplier <= r.noise_lower * (1 + 1e-3) * (1 + 1e-12)


@pytest.mark.integration
def test_tight_els_needs_less_noise_than_group_privacy():
    tight = calibrate_method("els", 4.0, 1e-6, 0.01, 100, 8).noise_multiplier
    group = calibrate_method("group", 4.0, 1e-6, 0.01, 100, 8).noise_multiplier
    assert tight < group


def test_infinite_epsilon_means_no_noise():
    r = calibrate_method("els", math.inf, 1e-6, 0.01, 100, 4)
    assert r.noise_multiplier == 0.0 and r.epsilon_achieved == math.inf


def test_infeasible_target_names_the_cell_and_the_reason():
    with pytest.raises(PrivacyError) as err:
        calibrate_method("els", 0.05, 1e-6, 1.0, 10, 4, max_noise_multiplier=5, cell="cell dataset=x method=els eps=0.05 budget=9")
    msg = str(err.value)
    assert "cell dataset=x method=els eps=0.05 budget=9" in msg
    assert "max_noise_multiplier = 5" in msg and "more steps" in msg


@pytest.mark.parametrize("bad", [dict(epsilon=0.0), dict(epsilon=-1.0), dict(sampling_rate=0.0), dict(delta=1.0), dict(group_size=0)])
def test_invalid_arguments(bad):
    args = dict(method="els", epsilon=1.0, delta=1e-6, sampling_rate=0.01, steps=10, group_size=2)
    args.update(bad)
    with pytest.raises(PrivacyError):
        calibrate_method(**args)


@pytest.mark.integration
def test_initial_guess_is_in_the_right_range():
    r = calibrate_method("els", 2.0, 1e-6, 0.01, 200, 4)
    g = initial_guess(mech("els", 0.01, 200, 4), 2.0, 1e-6)
    assert 0.5 < g / r.noise_multiplier < 2.0


def test_search_levels_coarse_to_fine():
    """The levels calibrate searches (and bench_calibration's library variant reuses): coarse discretizations
    scaled to the target, never finer than the fine one, each strictly finer than the last; the last at the
    calibration tolerance."""
    from userdp.privacy.calibration import search_levels

    assert search_levels(1.0) == [(5e-3, 3e-3, "A"), (1e-3, 3e-4, "B"), (1e-4, 1e-3, "C")]
    assert search_levels(4.0)[0] == (1e-2, 3e-3, "A")
    assert search_levels(4.0, tolerance=1e-2) == [(1e-2, 1e-2, "A"), (1e-3, 3e-4, "B"), (1e-4, 1e-2, "C")]
    assert search_levels(0.01) == [(1e-4, 1e-3, "C")]  # a tiny target: its coarse levels would be the fine one
    assert search_levels(1.0, discretization=1e-3) == [(5e-3, 3e-3, "A"), (1e-3, 1e-3, "C")]
