"""The audit's second estimator (Gaussian f-DP one-run bound), its ceilings, exposure and extraction (no model).

The f-DP bound (Mahloujifar, Melis and Chaudhuri 2025) is checked against a
simulated Gaussian mechanism whose epsilon is known: every canary's score is
its coin times mu plus unit Gaussian noise, so the release is exactly mu-GDP
for each canary. Over seeded trials the bound must exceed the true epsilon
in at most 5% of them (the stated confidence), and it must be tighter than
the (epsilon, delta) bound of Steinke et al. on the same guesses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from userdp.errors import ConfigError
from userdp.evaluation import audit, audit_stats, audit_targets


@pytest.mark.parametrize("mu,eps", [(0.5, 0.0), (1.0, 1.0), (2.0, 3.0), (4.0, 8.0), (0.1, 0.2)])
def test_gdp_delta_matches_the_gaussian_mechanism_by_integration(mu, eps):
    """delta(eps) = integral of max(0, p1 - e^eps p0) for N(mu, 1) vs N(0, 1), on a fine grid."""
    x = np.linspace(-12, mu + 12, 400_001)
    p1 = np.exp(-(x - mu) ** 2 / 2) / math.sqrt(2 * math.pi)
    p0 = np.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi)
    numeric = float(np.trapezoid(np.maximum(p1 - math.exp(eps) * p0, 0.0), x))
    assert audit_stats.gdp_delta(mu, eps) == pytest.approx(numeric, rel=1e-5, abs=1e-12)


def test_gdp_mu_inverts_gdp_delta():
    for eps, delta in ((0.5, 1e-5), (1.0, 1e-6), (8.0, 2.4e-5), (3.0, 1.3e-3)):
        mu = audit_stats.gdp_mu(eps, delta)
        assert audit_stats.gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-6)
    # more privacy (smaller mu) at a fixed delta is a smaller epsilon
    assert audit_stats.gdp_mu(1.0, 1e-5) < audit_stats.gdp_mu(2.0, 1e-5)


def test_fdp_rejection_is_monotone_and_needs_evidence():
    m, r, level = 200, 60, 0.01
    mus = np.linspace(0.1, 6, 40)
    rejected = [audit_stats.fdp_rejects(mu, m, r, 55, level) for mu in mus]
    assert rejected[0] and not rejected[-1]
    assert all(a >= b for a, b in zip(rejected, rejected[1:]))  # once accepted, accepted for every larger mu
    assert not audit_stats.fdp_rejects(0.1, m, r, 30, level)  # half right is what a coin gets
    assert audit_stats.epsilon_lower_bound_fdp(m, 40, 20, 1e-5, 0.05) == 0.0
    eps = audit_stats.epsilon_lower_bound_fdp(m, r, 55, 1e-5, level)
    assert eps > 0
    assert audit_stats.fdp_rejects(audit_stats.gdp_mu(eps, 1e-5), m, r, 55, level)
    assert not audit_stats.fdp_rejects(audit_stats.gdp_mu(eps + 1e-4, 1e-5), m, r, 55, level)


def _gaussian_trial(rng, m: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    included = rng.random(m) < 0.5
    return mu * included + rng.normal(size=m), included


@pytest.mark.parametrize("eps_true", [1.0, 4.0])
def test_fdp_bound_never_exceeds_a_simulated_gaussian_mechanism_and_beats_the_eps_delta_bound(eps_true):
    delta, m, trials = 1e-5, 400, 40
    mu = audit_stats.gdp_mu(eps_true, delta)
    rng = np.random.default_rng(int(eps_true * 10))
    fdp, one_run = [], []
    for _ in range(trials):
        score, included = _gaussian_trial(rng, m, mu)
        res = audit.audit_result({"loss": score, "likelihood_ratio": score}, included, delta=delta,
                                 confidence=0.95, guess_fractions=[0.05, 0.1, 0.2])
        fdp.append(res["epsilon_lower_bound_fdp"])
        one_run.append(res["epsilon_lower_bound"])
    fdp, one_run = np.array(fdp), np.array(one_run)
    # valid at 95%: a trial above the truth happens in at most 5% (+ 3 standard errors) of trials
    assert (fdp > eps_true).mean() <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert (one_run > eps_true).mean() <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    # and tighter: on the same guesses the f-DP bound is at least the (eps, delta) one, and not vacuous
    assert fdp.mean() > one_run.mean() and (fdp >= one_run).all()
    assert fdp.mean() > (0.05 if eps_true < 2 else 0.25 * eps_true)


def test_fdp_bound_is_valid_for_the_worst_gaussian_at_its_epsilon_over_many_seeds():
    """Many cheap trials of one guess set at the level: the rejection rate of the true mu is at most the level."""
    rng = np.random.default_rng(7)
    m, r, level, trials = 200, 20, 0.05, 2000
    mu = 2.0
    rejects = 0
    for _ in range(trials):
        score, included = _gaussian_trial(rng, m, mu)
        v = audit_stats.correct_guesses(score, included, r, 0)
        rejects += audit_stats.fdp_rejects(mu, m, r, v, level)
    assert rejects / trials <= level


def test_ceilings_are_all_correct_guesses_and_grow_with_canaries():
    c = audit.ceilings(200, 2.4e-5, 0.95, (0.05, 0.1, 0.2, 0.5))
    sets = audit_stats.guess_sets(200, [0.05, 0.1, 0.2, 0.5])
    level = 0.05 / len(sets)
    assert c["epsilon_lower_bound_ceiling"] == max(audit_stats.epsilon_lower_bound(200, g.guesses, g.guesses, 2.4e-5, level)
                                                   for g in sets)
    assert c["epsilon_lower_bound_ceiling"] == pytest.approx(2.755, abs=1e-3)  # the first audit's ceiling
    assert c["epsilon_lower_bound_fdp_ceiling"] > 4.0  # the f-DP bound can show more with the same canaries
    more = audit.ceilings(1000, 2.4e-5, 0.95, (0.05, 0.1, 0.2, 0.5))
    assert more["epsilon_lower_bound_ceiling"] > c["epsilon_lower_bound_ceiling"]
    assert more["epsilon_lower_bound_fdp_ceiling"] > c["epsilon_lower_bound_fdp_ceiling"]
    # the large-delta case of a 600-user local dataset: the (eps, delta) bound can show nothing
    big = audit.ceilings(200, 1.3e-3, 0.95, (0.05, 0.1, 0.2, 0.5))
    assert big["epsilon_lower_bound_ceiling"] == 0.0 and big["epsilon_lower_bound_fdp_ceiling"] > 0


def test_ceiling_check_refuses_warns_and_names_the_fix():
    def check(m, delta, target=8.0, audit_delta_set=False):
        c = audit.ceilings(m, delta)
        sugg = audit.ceilings(m, audit_targets.SUGGESTED_DELTA)
        return audit_targets.ceiling_check(c, canaries=m, delta=delta, audit_delta_set=audit_delta_set,
                                           epsilon_target=target, suggestion=sugg)

    status, msg = check(200, 1.3e-3)
    assert status == "warning" and "at delta = 0.0013" in msg and "200 canaries" in msg
    assert "audit.delta: 1e-06" in msg and "fewer canaries" in msg and "cannot exceed 0" in msg
    status, msg = check(200, 2.4e-5, target=1.0)
    assert status == "ok" and msg is None
    status, msg = check(200, 2.4e-5, target=8.0)
    assert status == "warning" and "below the target epsilon 8" in msg
    assert check(200, 2.4e-5, target=math.inf)[0] == "ok"
    # nothing at all can be shown: refused
    zero = {"epsilon_lower_bound_ceiling": 0.0, "epsilon_lower_bound_fdp_ceiling": 0.0}
    status, msg = audit_targets.ceiling_check(zero, canaries=4, delta=0.2, audit_delta_set=True, epsilon_target=1.0)
    assert status == "error" and "no bound above 0 is possible" in msg and "(audit.delta)" in msg


def test_exposure_ranks_the_secret_among_candidates():
    secret = np.array([0.5, 5.0, 3.0])
    cand = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
    # ranks among 4: 1 (best), 4 (worst), 2 (a tie counts against the secret)
    assert audit.exposure(secret, cand) == pytest.approx([2.0, 0.0, 1.0])
    # with no preference the mean exposure is about 1 / ln 2 bits
    rng = np.random.default_rng(0)
    e = audit.exposure(rng.random(4000), rng.random((4000, 255)))
    assert e.mean() == pytest.approx(1 / math.log(2), abs=0.06) and e.max() <= 8.0


def test_extraction_summary_reads_included_against_excluded():
    included = np.array([True, True, False, False])
    secrets = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    decoded = np.array([[1, 2], [3, 9], [5, 6], [0, 0]])
    out = audit.extraction_summary(included, secrets, decoded, np.array([8.0, 2.0, 1.0, 0.0]), 255)
    assert out["extraction_rate_included"] == 0.5 and out["extraction_rate_excluded"] == 0.5
    assert out["extraction_token_accuracy_included"] == 0.75
    assert out["exposure_included_mean"] == 5.0 and out["exposure_excluded_mean"] == 0.5 and out["exposure_max"] == 8
    none = audit.extraction_summary(included, secrets, decoded, np.full(4, np.nan), 0)
    assert math.isnan(none["exposure_included_mean"]) and none["exposure_candidates"] == 0


def test_secret_loss_and_greedy_decoding_on_a_tiny_model():
    """secret_nll is the loss of the secret's tokens only (the whole sequence's minus the prefix's), and each
    greedily decoded token is the model's argmax given everything before it."""
    import torch

    from userdp.evaluation.metrics import sequence_scores
    from userdp.training.models import build_model

    torch.manual_seed(0)
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = build_model({"architecture": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2}, 30, 16, ids, seed=0).eval()
    rng = np.random.default_rng(0)
    prefixes, secrets = rng.integers(3, 30, size=(7, 3)), rng.integers(3, 30, size=(7, 5))
    got = audit.secret_nll(model, prefixes, secrets, 1, batch_size=3, device="cpu")
    full = [np.array([1, *p, *s]) for p, s in zip(prefixes, secrets)]
    head = [np.array([1, *p]) for p in prefixes]
    with torch.no_grad():
        want = sequence_scores(model, full, 4)[0] - sequence_scores(model, head, 4)[0]
    assert got == pytest.approx(want, rel=1e-5)
    decoded = audit.greedy_continuations(model, prefixes, 5, 1, batch_size=4, device="cpu")
    seq = torch.from_numpy(np.concatenate([np.ones((7, 1), np.int64), prefixes, decoded], axis=1))
    with torch.no_grad():
        argmax = model(input_ids=seq).logits[:, 3:8].argmax(dim=-1).numpy()
    assert (argmax == decoded).all()


def test_the_claim_at_the_audit_delta_is_the_runs_accountant_there():
    import dp_accounting

    from userdp.privacy import accounting
    from userdp.privacy.mechanism import event_to_json

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.5)), 20)
    at_run = accounting.epsilon(event, 1e-3)
    ledger = {"epsilon": at_run, "delta": 1e-3, "dp_event": event_to_json(event)}
    assert audit.claim_at_delta(ledger, 1e-3) == at_run  # the ledger's own, not recomputed
    smaller = audit.claim_at_delta(ledger, 1e-6)
    assert smaller == pytest.approx(accounting.epsilon(event, 1e-6)) and smaller > at_run
    assert audit.claim_at_delta({"epsilon": "inf", "delta": 1e-3, "dp_event": None}, 1e-6) == math.inf
    with pytest.raises(ValueError, match="dp_event"):
        audit.claim_at_delta({"epsilon": at_run, "delta": 1e-3}, 1e-6)


def test_plan_time_check_uses_the_audit_delta_and_refuses_an_audit_that_can_show_nothing():

    section = {"canaries": 200, "confidence": 0.95, "guess_fractions": [0.05, 0.1, 0.2, 0.5], "delta": None}
    ceiling, warning = audit_targets.plan_time_check(section, 2.4e-5, dataset="d", method="uls", eps="1")
    assert ceiling["delta"] == 2.4e-5 and warning is None
    assert ceiling["epsilon_lower_bound_ceiling"] == pytest.approx(2.755, abs=1e-3)
    # a 600-user dataset's delta: warned, with the fix and the ceilings at the suggested delta
    ceiling, warning = audit_targets.plan_time_check(section, 1.3e-3, dataset="d", method="els", eps="8")
    assert ceiling["epsilon_lower_bound_ceiling"] == 0.0 and warning.startswith("the audit of d (els, eps 8)")
    assert "audit.delta: 1e-06" in warning and "2.82" in warning and "5.23" in warning
    # audit.delta replaces the runs' delta
    ceiling, warning = audit_targets.plan_time_check({**section, "delta": 1e-6}, 1.3e-3, dataset="d", method="els",
                                                     eps="1")
    assert ceiling["delta"] == 1e-6 and ceiling["epsilon_lower_bound_fdp_ceiling"] > 5 and warning is None
    with pytest.raises(ConfigError, match=r"the audit of d \(uls, eps 1\): at delta = 0.01 .* no bound above 0"):
        audit_targets.plan_time_check({**section, "canaries": 2, "delta": 0.01}, 2.4e-5, dataset="d", method="uls",
                                      eps="1")
