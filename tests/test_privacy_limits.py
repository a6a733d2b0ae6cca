"""Planning never crashes or exhausts memory (issue 11 section 8, issue 13).

* a delta at or above the probability that a user's data is used at all
  makes the guarantee vacuous: calibration refuses it, before any accounting;
* one accountant call is bounded in memory: PLD sizes are estimated before
  anything is allocated, and an oversized PLD is refused with a named error;
* calibration never reports a noise multiplier whose lower end it could not
  evaluate, and converges when probes reach epsilon = 0 (near-vacuous delta);
* the SNR rule skips candidates with less than `snr_min_cohort` users per
  step, or whose calibration is refused, with the reason in its table.
"""

from __future__ import annotations

import dataclasses
import math
import tracemalloc

import numpy as np
import pytest
from scipy import optimize, stats

from userdp.cli import main
from userdp.errors import AccountingLimitError, PrivacyError
from userdp.privacy import _dp_accounting_compat as compat
from userdp.privacy import accounting as A
from userdp.privacy import calibration as C
from userdp.privacy import group_size as GS
from userdp.privacy.contribution_stats import laplace_event
from userdp.privacy.contributions import ExactCounts
from userdp.privacy.mechanism import ELS, ULS

# ---------------------------------------------------------------- vacuous delta


def test_participation_probability_is_one_minus_never_sampled():
    assert ULS(0.01, 10).participation_probability() == pytest.approx(1 - 0.99**10, rel=1e-12)
    # ELS: each of the user's G examples is sampled independently in every step
    assert ELS(0.001, 20, 8).participation_probability() == pytest.approx(1 - 0.999 ** (20 * 8), rel=1e-12)
    assert ELS(1.0, 3, 2).participation_probability() == 1.0


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_delta_above_participation_needs_no_noise(sigma):
    """The reason for the refusal, checked with the real accountant: at delta >= p epsilon is 0 at any sigma."""
    mech = ULS(0.01, 5)
    p = mech.participation_probability()
    assert mech.epsilon(sigma, p * 1.001, discretization=1e-3) == 0.0
    assert mech.epsilon(sigma, p / 10, discretization=1e-3) > 0.0  # below p the noise matters


def test_vacuous_delta_is_refused_before_any_accounting(monkeypatch):
    def no_accounting(*args, **kwargs):
        raise AssertionError("the accountant ran for a vacuous setting")

    monkeypatch.setattr(A, "epsilon", no_accounting)
    # the command: q = 9e-5, T = 12, delta = 1.33e-3 > 1 - (1 - q)^12 = 1.08e-3
    with pytest.raises(PrivacyError) as err:
        C.calibrate(ULS(0.00009, 12), 4.0, 0.00133, cell="cell dataset=local method=uls eps=4 budget=960")
    msg = str(err.value)
    assert "vacuous" in msg and "0.00108" in msg and "cell dataset=local method=uls eps=4 budget=960" in msg
    assert "privacy.delta" in msg and "--delta" in msg  # the fix is named
    with pytest.raises(PrivacyError, match="vacuous"):  # ELS counts the user's G examples
        C.calibrate(ELS(1e-4, 10, 8), 4.0, 0.01)


def test_cli_vacuous_delta_exits_2_with_the_reason(capsys):
    args = ["calibrate", "--method", "uls", "--epsilon", "4", "--delta", "0.00133", "--sampling-rate", "0.00009",
            "--steps", "12"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "vacuous" in err and "Traceback" not in err


@pytest.mark.integration
def test_near_vacuous_delta_converges_and_is_certified():
    """delta just below p: probes with epsilon = 0 are feasible and the search must go down (it used to loop)."""
    mech = ULS(0.01, 10)
    delta = mech.participation_probability() / 1.01
    r = C.calibrate(mech, 2.0, delta, discretization=1e-3)
    assert mech.epsilon(r.noise_multiplier, delta, discretization=1e-3) <= 2.0
    assert mech.epsilon(r.noise_lower, delta, discretization=1e-3) > 2.0
    assert r.noise_lower < r.noise_multiplier <= r.noise_lower * (1 + 1e-3) * (1 + 1e-12)


# ---------------------------------------------------------------- memory bound of one accountant call


def _refused_cheaply(fn) -> str:
    """Run fn, expect AccountingLimitError; return its message. Python-level allocations stay small."""
    tracemalloc.start()
    try:
        with pytest.raises(AccountingLimitError) as err:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the refusal"
    return str(err.value)


def test_laplace_release_with_huge_epsilon_is_refused_before_it_is_built():
    # eps_stats = 1e4: privacy losses in [-1e4, 1e4], 2e8 grid points at 1e-4 (GBs) in dp-accounting
    msg = _refused_cheaply(lambda: ULS(0.01, 10).epsilon(1.0, 1e-6, extra_events=(laplace_event(1e4),)))
    assert "200,000,001 grid points" in msg and "MAX_PLD_POINTS" in msg and "Laplace" in msg


def test_tiny_noise_step_is_refused_before_its_grid_is_built():
    # sigma = 0.01 against sensitivities up to 64: privacy losses in the ten thousands
    msg = _refused_cheaply(lambda: ELS(0.5, 10, 64).epsilon(0.01, 1e-6))
    assert "mixture-of-Gaussians step (sigma = 0.01" in msg and "larger noise multiplier" in msg


def test_too_many_steps_are_refused_before_the_composition():
    msg = _refused_cheaply(lambda: ULS(1.0, 10_000_000).epsilon(1.0, 1e-6, discretization=1e-3))
    assert "composed 10000000 times" in msg and "fewer steps" in msg


def test_cli_epsilon_beyond_the_bound_exits_2(capsys):
    assert main(["epsilon", "--method", "uls", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps", "10",
                 "--delta", "1e-6", "--stats-epsilon", "10000"]) == 2
    err = capsys.readouterr().err
    assert "MAX_PLD_POINTS" in err and "Traceback" not in err


def test_size_estimate_matches_the_built_pld(monkeypatch):
    """The estimate the refusal uses is the size dp-accounting then allocates (step and T-fold composition)."""
    sens, probs = A.pruned_binomial_sensitivities(8, 0.02)
    losses_points = []
    real = A.check_pld_size
    monkeypatch.setattr(A, "check_pld_size", lambda points, what, d: (losses_points.append(points), real(points, what, d))[1])
    step = A.mixture_gaussian_pld(0.8, sens, probs, 1e-3)
    composed = A._compose(step, 50, 1e-3, "test")
    step_sizes = sorted(pmf.size for pmf in compat.pld_pmfs(step))
    assert sorted(losses_points[:2]) == step_sizes
    # the FFT length checked bounds the composed PMF dp-accounting returns
    assert max(losses_points[2:]) >= A.pld_points(composed) > max(step_sizes)


# ---------------------------------------------------------------- calibration with refused probes


@dataclasses.dataclass(frozen=True)
class _RefusingULS(ULS):
    """ULS whose accountant refuses every sigma below `below` (as the memory bound does at small sigma)."""

    below: float = 0.0

    def epsilon(self, noise_multiplier, delta, **kwargs):
        if noise_multiplier < self.below:
            raise AccountingLimitError(f"test bound: sigma = {noise_multiplier:g} < {self.below:g}")
        return super().epsilon(noise_multiplier, delta, **kwargs)


def test_refused_probes_far_below_the_root_do_not_change_the_answer():
    plain = C.calibrate(ULS(0.02, 100), 2.0, 1e-6)
    far = C.calibrate(_RefusingULS(0.02, 100, 1, below=plain.noise_multiplier / 3), 2.0, 1e-6)
    assert far.noise_multiplier == pytest.approx(plain.noise_multiplier, rel=2e-3)
    assert ULS(0.02, 100).epsilon(far.noise_lower, 1e-6) > 2.0  # its lower end was evaluated


def test_a_refused_lower_end_is_never_reported():
    plain = C.calibrate(ULS(0.02, 100), 2.0, 1e-6)
    with pytest.raises(AccountingLimitError, match="cannot certify"):
        C.calibrate(_RefusingULS(0.02, 100, 1, below=plain.noise_multiplier * 1.05), 2.0, 1e-6, cell="cell x")


def test_refused_maximum_says_the_target_is_out_of_reach():
    with pytest.raises(AccountingLimitError, match="far out of reach"):
        C.calibrate(_RefusingULS(0.5, 100, 1, below=1e9), 0.01, 1e-6, max_noise_multiplier=5)


# ---------------------------------------------------------------- initial guess for tiny targets


def test_initial_guess_for_a_tiny_epsilon_is_not_the_fallback():
    """epsilon = 1e-5: the GDP root mu lies below e^-12, outside the usual bracket.

    The guess used to fall back to sigma = 1 there (a first probe at a huge
    PLD). One step at q = 1e-4 is mu-GDP-like with mu ~ q / sigma, so the
    answer is sigma ~ q / mu*, with mu* the GDP mu meeting (epsilon, delta).
    """
    eps, delta, q = 1e-5, 1e-8, 1e-4

    def log_gap(log_mu):
        mu = math.exp(log_mu)
        d = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        return math.log(max(d, 1e-300)) - math.log(delta)

    mu = math.exp(optimize.brentq(log_gap, -40, 5))
    assert mu < math.exp(-12)
    guess = C.initial_guess(ULS(q, 1), eps, delta)
    assert guess == pytest.approx(q / mu, rel=0.05)
    # beyond the bracket's top (sigma > 1e4) the guess is its top, not the fallback
    assert C.initial_guess(ELS(1.0, 1000, 64), 1e-6, 1e-10) == 1e4


# ---------------------------------------------------------------- the SNR rule skips what it cannot plan


def _spy_calibrate(monkeypatch) -> list:
    from userdp.privacy import calibration

    calls: list = []
    real = calibration.calibrate

    def spy(mech, *args, **kwargs):
        calls.append(mech)
        return real(mech, *args, **kwargs)

    # the SNR rule imports calibrate where it calls it, so the spy sits in its home module
    monkeypatch.setattr(calibration, "calibrate", spy)
    return calls


@pytest.mark.integration
def test_snr_skips_small_cohorts_before_calibrating(monkeypatch):
    # 100 users with 3 examples, 100 with 1000: mbar_G grows to ~500 for large G
    counts = np.array([3] * 100 + [1000] * 100)
    calls = _spy_calibrate(monkeypatch)
    choice = GS.snr_group_size(ExactCounts(counts), 200, 960, 12, 4.0, 1 / 200**1.1, max_quantile=1.0)
    rows = {r["group_size"]: r for r in choice.table}
    small = [G for G, r in rows.items() if r["expected_batch"] < 1]
    assert small and all("snr_min_cohort = 1" in rows[G]["skipped"] for G in small)
    assert all(r["snr"] is not None for G, r in rows.items() if G not in small)
    assert len(calls) == len(rows) - len(small)  # nothing was calibrated for the skipped ones
    assert choice.group_size not in small


def test_snr_lists_a_vacuous_candidate_with_its_reason(monkeypatch):
    counts = np.array([1] * 100 + [5000] * 100)
    stats_ = ExactCounts(counts)
    monkeypatch.setattr(stats_, "group_size_candidates", lambda q: [1, 4096])
    delta = 1 / 200**1.1  # 2.9e-3; G = 4096: M = 80 / 2048.5 users per step, q_u = 1.95e-4, p = 2.3e-3
    choice = GS.snr_group_size(stats_, 200, 960, 12, 4.0, delta, min_cohort=1e-3)
    rows = {r["group_size"]: r for r in choice.table}
    assert "vacuous" in rows[4096]["skipped"] and rows[4096]["snr"] is None
    assert choice.group_size == 1
