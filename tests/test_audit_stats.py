"""The audit's statistics: the one-run epsilon lower bound, AUC, TPR at low FPR, guessing (no model).

The bound is checked against closed forms, against a brute-force evaluation
of Steinke, Nasr and Jagielski's p-value from its definition (exact binomial
sums with math.comb), and for validity: on an epsilon-DP randomized response
it exceeds epsilon in at most 5% of seeded trials.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from userdp.evaluation import audit, audit_report, audit_stats


def brute_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke et al.'s p-value bound from its definition, with exact binomial probabilities (Fractions)."""
    q = Fraction(math.exp(eps) / (1 + math.exp(eps)))
    pmf = [Fraction(math.comb(r, k)) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:], Fraction(0))
    alpha = max((sum(pmf[v - i:v], Fraction(0)) / i for i in range(1, v + 1)), default=Fraction(0))
    return min(float(beta + 2 * m * Fraction(delta) * alpha), 1.0)


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (100, 20, 18, 1.0, 0.0), (100, 20, 18, 1.0, 1e-5), (200, 50, 40, 2.5, 1e-4), (64, 10, 5, 0.0, 1e-3),
    (64, 32, 32, 3.0, 1e-6), (10, 1, 1, 0.5, 0.01), (50, 7, 0, 1.0, 1e-3),
])
def test_p_value_matches_its_definition(m, r, v, eps, delta):
    assert audit_stats.p_value(m, r, v, eps, delta) == pytest.approx(brute_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_p_value_grows_with_epsilon_and_delta():
    ps = [audit_stats.p_value(100, 30, 25, e, 1e-4) for e in np.linspace(0, 5, 11)]
    assert all(a < b for a, b in zip(ps, ps[1:]))
    assert audit_stats.p_value(100, 30, 25, 1.0, 1e-3) > audit_stats.p_value(100, 30, 25, 1.0, 1e-6)


def test_all_correct_guesses_give_the_closed_form_bound():
    # delta = 0, v = r: P[Bin(r, p) >= r] = p^r < level  <=>  eps < log(p* / (1 - p*)), p* = level^(1/r)
    for r in (5, 10, 40):
        p_star = 0.05 ** (1 / r)
        expected = math.log(p_star / (1 - p_star))
        got = audit_stats.epsilon_lower_bound(1000, r, r, 0.0, 0.05)
        assert got == pytest.approx(expected, abs=2e-6) and got <= expected
    assert audit_stats.epsilon_lower_bound(1000, 10, 10, 0.0, 0.05) == pytest.approx(1.0519, abs=1e-4)


def test_bound_is_the_edge_of_rejection_and_zero_without_evidence():
    m, r, v, delta, level = 200, 60, 50, 1e-5, 0.01
    eps = audit_stats.epsilon_lower_bound(m, r, v, delta, level)
    assert eps > 0
    assert audit_stats.p_value(m, r, v, eps, delta) < level <= audit_stats.p_value(m, r, v, eps + 1e-5, delta)
    # half the guesses right is what a coin gets: no evidence
    assert audit_stats.epsilon_lower_bound(m, 40, 20, delta, 0.05) == 0.0
    # a large delta term (2 m delta alpha >= level at eps = 0) leaves nothing to prove, however good the guesses
    assert audit_stats.p_value(64, 32, 32, 0.0, 0.02) >= 0.05
    assert audit_stats.epsilon_lower_bound(64, 32, 32, 0.02, 0.05) == 0.0
    assert audit_stats.epsilon_lower_bound(64, 32, 32, 1e-6, 0.05) > 1.5


def test_bound_is_valid_on_randomized_response():
    """An eps-DP mechanism (each guess right with probability e^eps/(1+e^eps)) is caught above eps in <= 5% of runs."""
    rng = np.random.default_rng(0)
    eps_true, r, trials = 1.0, 100, 400
    q = math.exp(eps_true) / (1 + math.exp(eps_true))
    correct = rng.binomial(r, q, size=trials)
    bounds = np.array([audit_stats.epsilon_lower_bound(r, r, int(v), 0.0, 0.05) for v in correct])
    assert (bounds > eps_true).mean() <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert np.median(bounds) > 0.4  # and it is not vacuous: typical runs find most of eps


def test_auc_and_tpr_against_brute_force():
    rng = np.random.default_rng(1)
    included = rng.random(300) < 0.5
    scores = rng.normal(size=300) + 0.8 * included
    scores[:20] = np.round(scores[:20])  # some ties
    pos, neg = scores[included], scores[~included]
    brute = np.mean([(a > b) + 0.5 * (a == b) for a in pos for b in neg])
    assert audit_stats.auc(scores, included) == pytest.approx(brute, rel=1e-12)
    best = 0.0
    for t in np.concatenate([scores, [np.inf]]):
        fpr = np.mean(neg >= t)
        if fpr <= 0.01:
            best = max(best, float(np.mean(pos >= t)))
    assert audit_stats.tpr_at_fpr(scores, included, 0.01) == best
    perfect = np.where(included, 1.0, 0.0)
    assert audit_stats.auc(perfect, included) == 1.0 and audit_stats.tpr_at_fpr(perfect, included) == 1.0
    assert audit_stats.auc(-perfect, included) == 0.0 and audit_stats.tpr_at_fpr(-perfect, included) == 0.0


def test_correct_guesses_and_guess_sets():
    included = np.array([True, False, True, False, True, False])
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    assert audit_stats.correct_guesses(scores, included, 2, 0) == 1  # top two: True, False
    assert audit_stats.correct_guesses(scores, included, 1, 1) == 2  # top True, bottom False
    assert audit_stats.correct_guesses(scores, included, 0, 3) == 2  # bottom three: True, False, False -> 2 "out" right
    with pytest.raises(ValueError):
        audit_stats.correct_guesses(scores, included, 4, 3)
    sets = audit_stats.guess_sets(200, [0.05, 0.5])
    assert {(g.score, g.side, g.n_in, g.n_out) for g in sets} == {
        (s, side, n_in, n_out) for s in audit_stats.SCORES
        for side, n_in, n_out in (("top", 10, 0), ("both", 5, 5), ("top", 100, 0), ("both", 50, 50))}


def test_audit_result_is_bonferroni_corrected_and_tells_perfect_from_random():
    rng = np.random.default_rng(2)
    included = rng.random(200) < 0.5
    separated = {"loss": np.where(included, 1.0, 0.0) + 1e-3 * rng.random(200),
                 "likelihood_ratio": rng.normal(size=200)}
    res = audit.audit_result(separated, included, delta=1e-6, confidence=0.95, guess_fractions=[0.1, 0.5])
    assert res["level_per_guess_set"] == pytest.approx(0.05 / len(res["guess_sets"]))
    assert res["loss_auc"] > 0.99 and res["loss_epsilon_lower_bound"] > 2.0
    assert res["epsilon_lower_bound"] == res["loss_epsilon_lower_bound"] == res["best_guess_set"]["epsilon_lower_bound"]
    assert 0.35 < res["likelihood_ratio_auc"] < 0.65 and res["likelihood_ratio_epsilon_lower_bound"] < 0.5
    # the bound of the best set recomputed at the corrected level
    best = res["best_guess_set"]
    again = audit_stats.epsilon_lower_bound(200, best["guesses_in"] + best["guesses_out"], best["correct"], 1e-6,
                                      res["level_per_guess_set"])
    assert again == best["epsilon_lower_bound"]
    assert res["epsilon_lower_bound"] <= res["epsilon_lower_bound_ceiling"]
    assert res["epsilon_lower_bound_ceiling"] == max(
        audit_stats.epsilon_lower_bound(200, g["guesses_in"] + g["guesses_out"], g["guesses_in"] + g["guesses_out"], 1e-6,
                                  res["level_per_guess_set"]) for g in res["guess_sets"])


def test_summary_flags_a_bound_above_the_claim():
    rows = [{"dataset": "d", "method": "els", "epsilon_target": 1.0, "epsilon_claimed": 1.0, "epsilon_lower_bound": 1.5,
             "canaries": 10, "confidence": 0.95, "bound_exceeds_claim": True},
            {"dataset": "d", "method": "els", "epsilon_target": "inf", "epsilon_claimed": "inf",
             "epsilon_lower_bound": 3.0, "canaries": 10, "confidence": 0.95, "bound_exceeds_claim": False}]
    assert audit_report.bound_exceeds_claim(rows[0]) and not audit_report.bound_exceeds_claim(rows[1])
    df = audit_report.summary_rows(rows)
    assert df["epsilon_claimed"].tolist() == [1.0, math.inf]
    html = audit_report.summary_html(df, "d")
    assert "<table" in html and "∞" in html and html.count("<tr") == 3  # the header and two cells
    assert "ELS" in html and "<td>yes</td>" in html and "<td>no</td>" in html and "None" not in html


def test_audit_figure_shows_claims_bounds_and_the_diagonal(tmp_path):
    from userdp.plotting.audit import empirical_vs_claimed
    from userdp.plotting.registry import FIGURES

    rows = [{"dataset": "d", "method": m, "epsilon_target": e, "epsilon_claimed": e, "epsilon_lower_bound": b,
             "likelihood_ratio_auc": a, "canaries": 200, "confidence": 0.95, "bound_exceeds_claim": False,
             "epsilon_lower_bound_ceiling": 2.5}
            for m, e, b, a in (("els", 8.0, 0.2, 0.55), ("uls", 8.0, 0.0, 0.5), ("els", "inf", 2.1, 0.97),
                               ("uls", "inf", 1.9, 0.95))]
    df = audit_report.summary_rows(rows)
    fig = empirical_vs_claimed(df, dataset="d")
    ax = fig.axes[0]
    (diag,) = [ln for ln in ax.lines if "y = x" in ln.get_label()]
    assert list(diag.get_xdata()) == list(diag.get_ydata())
    assert any(ln.get_ydata()[0] == 2.5 and "largest (ε, δ) bound" in ln.get_label() for ln in ax.lines)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "∞\n(non-private)"]
    ys = sorted(float(y) for c in ax.collections for _, y in c.get_offsets())
    assert ys == [0.0, 0.2, 1.9, 2.1]
    fig.clf()
    # with the f-DP bound: a hollow point per cell and its own ceiling line
    for r, f in zip(rows, (0.4, 0.1, 4.2, 4.0)):
        r.update(epsilon_lower_bound_fdp=f, epsilon_lower_bound_fdp_ceiling=4.5)
    fig = empirical_vs_claimed(audit_report.summary_rows(rows), dataset="d")
    ax = fig.axes[0]
    ys = sorted(float(y) for c in ax.collections for _, y in c.get_offsets())
    assert ys == [0.0, 0.1, 0.2, 0.4, 1.9, 2.1, 4.0, 4.2]
    assert any(ln.get_ydata()[0] == 4.5 and "f-DP" in ln.get_label() for ln in ax.lines)
    assert ax.get_ylim()[1] > 4.5
    fig.clf()
    path = tmp_path / "summary.parquet"
    df.to_parquet(path)
    FIGURES["audit_epsilon"].draw({"summary": str(path)}, tmp_path / "f.png", tmp_path / "f.pdf", dataset="d")
    assert (tmp_path / "f.png").stat().st_size > 1000 and (tmp_path / "f.pdf").exists()


def test_white_box_figure_plots_each_method_and_process_count(tmp_path):
    from userdp.plotting.audit import mechanism_vs_claimed
    from userdp.plotting.registry import FIGURES

    rows = [{"dataset": "d", "method": m, "epsilon_target": 2.0, "epsilon_claimed": 1.999, "epsilon_lower_bound": b,
             "epsilon_lower_bound_ceiling": 3.9, "epsilon_lower_bound_fdp": f, "epsilon_lower_bound_fdp_ceiling": 6.7,
             "canaries": 1000, "processes": p}
            for m, p, b, f in (("els", 1, 0.3, 0.9), ("uls", 1, 0.0, 0.5), ("els", 2, 0.1, 1.2), ("uls", 2, 0.2, 0.7))]
    fig = mechanism_vs_claimed(pd.DataFrame(rows), dataset="d")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for series in ("ELS, 1 process", "ELS, 2 processes", "ULS, 1 process", "ULS, 2 processes"):
        assert series in labels and f"{series}, f-DP bound (Gaussian trade-off)" in labels
    assert not any("AUC" in label for label in labels)  # the white-box table has no AUC
    ys = sorted(float(y) for c in ax.collections for _, y in c.get_offsets())
    assert ys == [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.2]
    assert "white-box" in ax.get_title() and "1000 Dirac canary users" in ax.get_title()
    assert any(ln.get_ydata()[0] == 6.7 for ln in ax.lines) and any(ln.get_ydata()[0] == 3.9 for ln in ax.lines)
    fig.clf()
    # one process count: one series per method, named by the method only
    fig = mechanism_vs_claimed(pd.DataFrame(rows[:2]), dataset="d")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "ELS" in labels and "ULS" in labels and not any("process" in label for label in labels)
    fig.clf()
    path = tmp_path / "mechanism.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    FIGURES["audit_mechanism_epsilon"].draw({"mechanism": str(path)}, tmp_path / "f.png", tmp_path / "f.pdf",
                                            dataset="d")
    assert (tmp_path / "f.png").stat().st_size > 1000 and (tmp_path / "f.pdf").exists()
