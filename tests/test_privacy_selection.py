"""The released model's guarantee: learning-rate selection composed, per run, or by random stopping (RDP)."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp.errors import ConfigError, PrivacyError
from userdp.privacy import calibration, mechanism, rdp
from userdp.privacy.planner import plan_cell
from userdp.privacy.selection import Selection

DELTA = 1e-6


# ---------------------------------------------------------------- RDP of the MoG step


@pytest.mark.parametrize("sigma,q", [(0.8, 0.01), (1.0, 0.1), (2.0, 0.5), (5.0, 1.0)])
def test_mog_rdp_at_g1_is_the_subsampled_gaussian(sigma, q):
    """G = 1: the MoG {0: 1-q, 1: q} is dp-accounting's Poisson-subsampled Gaussian (exact at integer orders)."""
    ours = rdp.mog_rdp(sigma, [0.0, 1.0], [1 - q, q])
    theirs = np.asarray(rdp_lib._compute_rdp_poisson_subsampled_gaussian(q, sigma, rdp.ORDERS))
    integer = np.array([float(a).is_integer() for a in rdp.ORDERS])
    np.testing.assert_allclose(ours[integer], theirs[integer], rtol=1e-8)
    # dp-accounting's fractional orders are an upper bound (its series); ours is the integral itself.
    frac = ~integer & np.isfinite(theirs)
    assert np.all(ours[frac] <= theirs[frac] * (1 + 1e-9))


@pytest.mark.parametrize("sigma,q,G", [(1.0, 0.01, 8), (2.0, 0.05, 16), (0.9, 0.2, 4)])
def test_mog_rdp_at_order_two_is_the_closed_form_chi_square(sigma, q, G):
    """D_2(P || Q) = log(1 + chi^2(P || Q)): the closed form calibration's first guess already uses."""
    mech = mechanism.ELS(q, 10, G)
    ours = rdp._rdp_of(mech.step_event(sigma), [2.0])[0]
    assert ours == pytest.approx(math.log1p(math.exp(mech.log_chi2_step(sigma))), rel=1e-9)


def test_rdp_epsilon_of_repeat_and_select_matches_dp_accounting_for_uls():
    """Our composition (the run's RDP, then dp-accounting's repeat-and-select) equals its own accountant."""
    run = mechanism.ULS(0.01, 500).dp_event(1.1)
    for mean, shape in [(3.0, 1.0), (10.0, 0.0), (5.0, 2.5)]:
        event = dp_accounting.dp_event.RepeatAndSelectDpEvent(run, mean, shape)
        acc = rdp_lib.RdpAccountant(list(rdp.ORDERS))
        acc.compose(event)
        assert rdp.epsilon(event, DELTA) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert rdp.epsilon(mechanism.NON_PRIVATE, DELTA) == math.inf


def test_rdp_is_an_upper_bound_of_the_tight_pld_for_one_els_run():
    """RDP is looser than PLD, never tighter (a sanity check of the numerical MoG integral at G > 1)."""
    mech = mechanism.ELS(0.02, 200, 8)
    pld = mech.epsilon(3.0, DELTA)
    assert pld < rdp.epsilon(mech.dp_event(3.0), DELTA) < 2 * pld


# ---------------------------------------------------------------- Selection


def test_selection_from_config_and_records():
    assert Selection.from_config({}, [1e-3, 1e-2, 1e-1]) == Selection("composed", 3)
    assert Selection.from_config({"selection": {"accounting": "per_run"}}, [1e-3]).record() == {"accounting": "per_run"}
    rs = Selection.from_config({"selection": {"accounting": "random_stopping", "shape": 0}}, [1e-3, 1e-2])
    assert rs.record() == {"accounting": "random_stopping", "candidates": 2, "mean_runs": 2.0, "shape": 0.0}
    assert Selection.from_record(rs.record()) == rs
    with pytest.raises(ConfigError, match="privacy.selection.accounting is 'best'"):
        Selection("best", 2)
    with pytest.raises(ConfigError, match="mean_runs"):
        Selection("random_stopping", 2, 0.5, 1.0)
    with pytest.raises(ConfigError, match="shape"):
        Selection("random_stopping", 2, 3.0, math.inf)


@pytest.mark.integration
@pytest.mark.parametrize("method,G", [("uls", 1), ("els", 4)])
def test_composed_calibration_makes_the_released_model_meet_the_target(method, G):
    """Default: each of k runs is calibrated so that the k runs composed meet epsilon."""
    mech = mechanism.get(method)(0.02, 100, G)
    sel = Selection("composed", 3)
    cal = calibration.calibrate(sel.calibration_mechanism(mech), 2.0, DELTA)
    released = sel.released_epsilon(mech, cal.noise_multiplier, DELTA)
    assert released <= 2.0 and released == pytest.approx(2.0, rel=0.01)
    alone = calibration.calibrate(mech, 2.0, DELTA).noise_multiplier
    assert cal.noise_multiplier > 1.1 * alone  # more noise per run than one run alone needs
    assert mech.epsilon(cal.noise_multiplier, DELTA) < 2.0 / 1.25


@pytest.mark.parametrize("method,G", [("uls", 1), ("els", 4)])
def test_random_stopping_calibration_meets_the_target_and_beats_composition_for_ten_rates(method, G):
    mech = mechanism.get(method)(0.02, 100, G)
    rs = Selection("random_stopping", 10, 10.0, 1.0)
    cal = calibration.calibrate(rs.calibration_mechanism(mech), 2.0, DELTA)
    event = rs.released_event([mech.dp_event(cal.noise_multiplier)])
    assert isinstance(event, dp_accounting.dp_event.RepeatAndSelectDpEvent)
    assert rdp.epsilon(event, DELTA) <= 2.0
    composed = calibration.calibrate(Selection("composed", 10).calibration_mechanism(mech), 2.0, DELTA)
    assert cal.noise_multiplier < 0.9 * composed.noise_multiplier


def test_random_stopping_refuses_runs_of_different_mechanisms():
    rs = Selection("random_stopping", 2, 2.0, 1.0)
    a, b = mechanism.ULS(0.02, 100).dp_event(1.0), mechanism.ULS(0.02, 100).dp_event(1.5)
    with pytest.raises(PrivacyError, match="repeats ONE mechanism"):
        rs.released_event([a, b])


@pytest.mark.integration
def test_the_plan_records_what_its_epsilon_means():
    counts = np.full(400, 6)
    common = dict(dataset="d", method="uls", epsilon=2.0, compute_budget=2400, steps=40, counts=counts,
                  privacy={"delta": DELTA, "group_size": {"uls": 4}})
    one = plan_cell(**common)
    three = plan_cell(**common, selection=Selection("composed", 3))
    per_run = plan_cell(**common, selection=Selection("per_run", 3))
    assert one.epsilon_target_of == three.epsilon_target_of == "released model"
    assert per_run.epsilon_target_of == "each learning-rate run" and per_run.selection.record() == {"accounting": "per_run"}
    assert per_run.noise_multiplier == one.noise_multiplier == pytest.approx(one.noise_multiplier)
    assert three.noise_multiplier > 1.1 * one.noise_multiplier
    assert three.epsilon_achieved <= 2.0 and three.epsilon_per_run < 2.0 / 1.25
    assert one.epsilon_per_run == one.epsilon_achieved
    # The plan's event is one run's T steps (what training runs), whatever the selection.
    run = three.mechanism.dp_event(three.noise_multiplier)
    assert mechanism.event_from_json(three.dp_event) == run
    assert Selection("composed", 3).released_epsilon(three.mechanism, three.noise_multiplier,
                                                     DELTA) == pytest.approx(three.epsilon_achieved, rel=1e-9)


def test_a_complete_runs_ledger_epsilon_is_the_plans_per_run_epsilon():
    """Invariant: the ledger recomputes one run's epsilon from what ran; under composed selection that is the
    plan's `epsilon_per_run` (not the released `epsilon_achieved`), and select_lr gives back the released one."""
    from userdp.evaluation.select import with_selection_epsilon
    from userdp.training.ledger import RunFacts, build_ledger

    plan = plan_cell(dataset="d", method="els", epsilon=2.0, compute_budget=2400, steps=40, counts=np.full(400, 6),
                     privacy={"delta": DELTA, "group_size": {"els": 4}}, selection=Selection("composed", 3))
    ledger = build_ledger(plan, RunFacts(steps_completed=40, expected_batch=plan.expected_batch, n_train_users=400,
                                 n_pool_examples=1600, examples_processed=2400, users_processed=400,
                                 learning_rate=1e-3, training={}, seeds={"run": 0}))
    assert ledger["epsilon"] == pytest.approx(plan.epsilon_per_run, rel=1e-9)
    assert ledger["epsilon_plan_per_run"] == plan.epsilon_per_run < plan.epsilon_achieved
    released = with_selection_epsilon(ledger, [ledger] * 3, ["a", "b", "c"])
    assert released["epsilon"] == pytest.approx(plan.epsilon_achieved, rel=1e-9) and released["epsilon"] <= 2.0


def test_the_rdp_integral_is_refused_up_front_above_its_bound(monkeypatch):
    """Memory of the MoG RDP is bounded (blocks); a grid over MAX_RDP_POINTS is a named error before any work."""
    from userdp.errors import AccountingLimitError

    integrals: list = []
    real = rdp._log_integral
    monkeypatch.setattr(rdp, "_log_integral", lambda *a: integrals.append(a) or real(*a))
    event = mechanism.ELS(0.02, 100, 256).step_event(0.05)
    with pytest.raises(AccountingLimitError, match="RDP integral"):
        rdp._rdp_of(event, rdp.ORDERS)
    assert integrals == []  # refused before integrating any order
    rdp._rdp_of(mechanism.ELS(0.02, 100, 8).step_event(1.0), [2.0])
    assert len(integrals) == 2  # a normal case integrates (forward and backward)


def test_the_meaning_reads_for_one_and_for_several_runs():
    from userdp.privacy.selection import Selection

    assert Selection("composed", 1).meaning() == "released model: its one learning-rate run (target met by the " \
        "selection)"
    assert "the 3 learning-rate runs composed" in Selection("per_run", 3).meaning()
