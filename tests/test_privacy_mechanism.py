"""The mechanism objects: sampling for a budget, events, their serialisation, and the event accountant."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant

from userdp.errors import PrivacyError
from userdp.privacy import accounting, mechanism
from userdp.privacy.contribution_stats import NoisyHistogram
from userdp.privacy.contributions import ExactCounts
from userdp.privacy.spec import RunSpec
from userdp.training.ledger import RunFacts, build_ledger, guarantee_epsilon, run_event


def test_sampling_for_budget_spends_the_budget():
    counts = np.array([1, 2, 3, 10, 40])
    G = 4
    n_bounded = int(np.minimum(counts, G).sum())
    mbar = float(np.minimum(counts, G).mean())
    els, s_els = mechanism.ELS.for_budget(200, 20, G, counts.size, n_bounded, mbar)
    assert s_els.unit == "examples" and s_els.expected_batch == 10 and els.sampling_rate == 10 / n_bounded
    uls, s_uls = mechanism.ULS.for_budget(60, 20, G, counts.size, n_bounded, mbar)
    assert s_uls.unit == "users" and s_uls.expected_batch == pytest.approx(60 / (20 * mbar))
    assert uls.sampling_rate == pytest.approx(s_uls.expected_batch / counts.size)
    for s in (s_els, s_uls):
        assert s.expected_compute == pytest.approx(200 if s is s_els else 60)
    with pytest.raises(PrivacyError, match=r"cell X: sampling rate .* > 1 .*more steps"):
        mechanism.ELS.for_budget(10_000, 1, G, counts.size, n_bounded, mbar, where="cell X")


def test_events_describe_what_runs():
    els = mechanism.ELS(0.1, 7, 3)
    ev = els.dp_event(1.5)
    assert isinstance(ev, dp_accounting.SelfComposedDpEvent) and ev.count == 7
    step = ev.event
    assert isinstance(step, dp_accounting.dp_event.MixtureOfGaussiansDpEvent)
    assert step.sensitivities == [0.0, 1.0, 2.0, 3.0]
    assert math.fsum(step.sampling_probs) == pytest.approx(1.0)
    uls = mechanism.ULS(0.1, 7, 3)
    assert uls.dp_event(1.5) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.5)), 7)
    assert isinstance(uls.dp_event(0.0), dp_accounting.NonPrivateDpEvent)
    assert isinstance(uls.dp_event(1.0, steps=0), dp_accounting.NoOpDpEvent)
    # ULS accounting never depends on G.
    assert mechanism.ULS(0.1, 7, 3).epsilon(1.5, 1e-5) == mechanism.ULS(0.1, 7, 1).epsilon(1.5, 1e-5)


@pytest.mark.parametrize("event", [
    mechanism.ELS(0.05, 30, 4).dp_event(1.2),
    mechanism.ULS(0.05, 30, 4).dp_event(1.2),
    mechanism.compose([dp_accounting.LaplaceDpEvent(10.0), mechanism.ULS(0.05, 30).dp_event(1.2)]),
    dp_accounting.NonPrivateDpEvent(),
])
def test_event_json_round_trip(event):
    data = json.loads(json.dumps(mechanism.event_to_json(event)))
    assert mechanism.event_from_json(data) == event


def test_event_from_json_builds_only_dp_accounting_events():
    with pytest.raises(PrivacyError, match="not a dp-accounting event"):
        mechanism.event_from_json({"module_name": "os", "class_name": "system"})
    with pytest.raises(PrivacyError, match="unknown dp-accounting event class"):
        mechanism.event_from_json({"module_name": "dp_accounting.dp_event", "class_name": "PLDAccountant"})


@pytest.mark.integration
def test_the_accountant_agrees_with_dp_accounting_on_composed_events():
    sigma, q, T, delta = 1.1, 0.05, 40, 1e-5
    lap = dp_accounting.LaplaceDpEvent(5.0)
    event = mechanism.compose([lap, mechanism.ULS(q, T).dp_event(sigma), mechanism.ULS(q, T).dp_event(sigma)])
    ref = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    ref.compose(event)
    assert accounting.epsilon(event, delta) == pytest.approx(ref.get_epsilon(delta), rel=1e-6)


@pytest.mark.integration
def test_identical_runs_compose_as_one_longer_run():
    """k runs of T steps of one mechanism are k * T steps (learning-rate selection's composition)."""
    els = mechanism.ELS(0.02, 50, 3)
    three = guarantee_epsilon([els.dp_event(1.3)] * 3, 1e-6)
    assert three == els.epsilon(1.3, 1e-6, steps=150)
    assert three > els.epsilon(1.3, 1e-6)


def test_unsupported_events_are_refused():
    with pytest.raises(PrivacyError, match="not supported"):
        accounting.epsilon(dp_accounting.RandomizedResponseDpEvent(0.1, 2), 1e-6)


def test_method_names_are_parsed_once():
    assert mechanism.get("els") is mechanism.ELS and mechanism.get("uls") is mechanism.ULS
    with pytest.raises(PrivacyError, match="allowed: els, uls"):
        mechanism.get("group")
    assert mechanism.get("group", comparison=True) is mechanism.GroupPrivacyELS
    with pytest.raises(PrivacyError, match="comparison figure only"):
        mechanism.GroupPrivacyELS(0.01, 10, 2).epsilon(1.0, 1e-6, extra_events=[dp_accounting.LaplaceDpEvent(1.0)])


def _plan(method: str, sigma: float = 1.2) -> RunSpec:
    return RunSpec(dataset="d", method=method, sampling_rate=0.05, steps=30, group_size=4, noise_multiplier=sigma,
                   delta=1e-5, clip_norm=1.0, clipping="flat", epsilon=3.0, expected_batch=5.0, compute_budget=150)


@pytest.mark.parametrize("method", [pytest.param("els", marks=pytest.mark.integration), "uls"])
def test_the_ledger_records_the_event_that_ran_and_its_epsilon(method):
    plan = _plan(method)
    ledger = build_ledger(plan, RunFacts(steps_completed=12, expected_batch=5.0, n_train_users=10,
                                 n_pool_examples=40, examples_processed=60, users_processed=12,
                                 learning_rate=1e-3, training={}, seeds={"run": 0}))
    mech = plan.mechanism
    assert run_event(ledger) == mech.dp_event(1.2, steps=12)
    assert ledger["epsilon"] == mech.epsilon(1.2, 1e-5, steps=12)
    # A ledger written before events were recorded is read from its mechanism fields.
    old = {k: v for k, v in ledger.items() if k != "dp_event"}
    assert run_event(old) == run_event(ledger)


def test_lower_median_and_candidates_share_one_quantile_rule():
    # Even number of users with distinct middle counts: the lower median (3), a count some user has.
    exact = ExactCounts([1, 3, 5, 9])
    assert exact.median_group_size() == 3 and exact.quantile(0.99) == 9
    assert exact.group_size_candidates(0.99) == [1, 2, 4, 8]
    # The DP histogram uses the same rule on its bins (lower edges).
    hist = NoisyHistogram(np.array([1, 2, 4, 8]), np.array([1.0, 1.0, 1.0, 1.0]), 1.0)
    assert hist.median_group_size() == 2 and hist.group_size_candidates(0.99) == [1, 2, 4, 8]
    assert exact.dp_events == () and len(hist.dp_events) == 1


def test_learning_rate_selection_composes_the_dp_statistics_release_once():
    from userdp.evaluation.select import with_selection_epsilon

    plan = _plan("uls").replace(contribution_stats={"private": True, "dp_event": {"type": "LaplaceDpEvent",
                                                                                  "noise_multiplier": 5.0}})
    ledger = build_ledger(plan, RunFacts(steps_completed=30, expected_batch=5.0, n_train_users=10,
                                 n_pool_examples=40, examples_processed=150, users_processed=30,
                                 learning_rate=1e-3, training={}, seeds={"run": 0}))
    out = with_selection_epsilon(ledger, [ledger, ledger], ["a", "b"])
    run = mechanism.ULS(0.05, 30, 4).dp_event(1.2)
    once = accounting.epsilon(mechanism.compose([dp_accounting.LaplaceDpEvent(5.0), run, run]), 1e-5)
    assert out["epsilon"] == once and out["epsilon_one_run"] == ledger["epsilon"]
    assert once < accounting.epsilon(mechanism.compose([dp_accounting.LaplaceDpEvent(5.0)] * 2 + [run, run]), 1e-5)
