"""The findings table: effects, intervals and verdicts on small tables with known answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from userdp.evaluation import findings as F
from userdp.evaluation import findings_job
from userdp.config import validate_config
from userdp.io import write_json, write_parquet

SEEDS = (0, 1, 2)
NOISE = (-0.001, 0.0, 0.001)  # per-seed offsets: sd 0.001, so effects of 0.05 are far above the noise


# ---------------------------------------------------------------- the statistics and the rule
def test_contrast_is_welchs_interval():
    a, b = [1.0, 1.2, 1.1, 1.4], [0.7, 0.9, 0.6]
    effect, lo, hi = F.contrast([(1.0, F.CellStats.of(a)), (-1.0, F.CellStats.of(b))])
    ref = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert effect == pytest.approx(np.mean(a) - np.mean(b))
    assert (lo, hi) == pytest.approx((ref.low, ref.high))


def test_contrast_with_constants_and_single_values():
    assert F.contrast([(1.0, F.CellStats.constant(2.0)), (-1.0, F.CellStats.constant(0.5))]) == (1.5, 1.5, 1.5)
    # one seed: the variance is unknown, so the interval is unbounded (never narrower than the data allow)
    effect, lo, hi = F.contrast([(1.0, F.CellStats.of([2.0])), (-1.0, F.CellStats.of([1.0, 1.1]))])
    assert effect == pytest.approx(0.95) and lo == -math.inf and hi == math.inf


@pytest.mark.parametrize("lo,hi,direction,threshold,expected", [
    (-0.3, -0.1, "<", 0.0, F.REPRODUCED),
    (0.1, 0.3, "<", 0.0, F.NOT_REPRODUCED),
    (-0.1, 0.1, "<", 0.0, F.INCONCLUSIVE),
    (0.1, 0.3, ">", 0.0, F.REPRODUCED),
    (-0.3, -0.1, ">", 0.0, F.NOT_REPRODUCED),
    (-0.02, 0.05, ">", -0.05, F.REPRODUCED),  # within the tolerance
    (-0.2, -0.1, ">", -0.05, F.NOT_REPRODUCED),
    (0.0, 0.0, "<", 0.0, F.NOT_REPRODUCED),   # exactly at the threshold is not on the claimed side
])
def test_verdict_rule(lo, hi, direction, threshold, expected):
    assert F.verdict(lo, hi, direction, threshold) == expected


def test_verdict_rejects_unknown_direction():
    with pytest.raises(ValueError, match="direction"):
        F.verdict(0, 1, "<=")


# ---------------------------------------------------------------- language model
def lm_summary(loss, epsilons=(1.0, 8.0), budgets=(1000, 16000), sweep=(), rule_g=None, seeds=SEEDS, noise=NOISE):
    """Summary rows with test_loss = loss(method, eps, budget, g) + a per-seed offset."""
    rows = []
    rule_g = rule_g or {"els": 8, "uls": 2}
    for m in ("els", "uls"):
        for e in (*epsilons, math.inf):
            for k in budgets:
                for s, n in zip(seeds, noise):
                    rows.append(dict(method=m, epsilon=e, budget=k, seed=s, group_size=rule_g[m],
                                     is_group_sweep=False, test_loss=loss(m, e, k, None) + n))
        for g in sweep:
            for s, n in zip(seeds, noise):
                rows.append(dict(method=m, epsilon=epsilons[0], budget=budgets[0], seed=s, group_size=g,
                                 is_group_sweep=True, test_loss=loss(m, epsilons[0], budgets[0], g) + n))
    return pd.DataFrame(rows)


def study_loss(diverse: bool, sign: float = 1.0):
    """ULS better at small eps, more so at large budgets and for diverse users (sign=-1 flips every effect)."""
    def loss(m, e, k, g):
        base = 3.0 - 0.1 * math.log10(k)
        if m == "uls" and math.isfinite(e):
            gain = 0.05 * math.log10(k / 100) / e * (2.0 if diverse else 1.0)
            base -= sign * gain
        if g is not None:  # G-sweep cells: G = 8 is best; ULS's sweep beats its rule's cell (G = 2) by 0.04
            base += 0.02 * abs(math.log2(g) - 3) - (0.04 if m == "uls" else 0.0)
        return base
    return loss


def by_claim(found, domain=F.LM):
    # claim 6 has a row per method, its claim text suffixed with "(ELS)" / "(ULS)"
    return {f.claim_id if f.claim == F.CLAIMS[f.claim_id] else (f.claim_id, f.claim[-4:-1]): f
            for f in found if f.domain == domain}


def run_lm(sign=1.0, **kw):
    summaries = {"homog": lm_summary(study_loss(False, sign), **kw),
                 "diverse": lm_summary(study_loss(True, sign), **kw)}
    pretrained = {"homog": 3.5, "diverse": 3.5}
    return by_claim(F.lm_findings(summaries, pretrained, {"homog": 0.1, "diverse": 10.0},
                                  {"epsilon": 1.0, "budget": 1000}, tolerance=0.01))


def test_lm_claims_reproduced_when_the_data_show_them():
    c = run_lm(sweep=(1, 8, 32))
    assert c[1].verdict == F.REPRODUCED and c[1].effect < 0
    # claim 1: mean over the two datasets at eps 1, K 16000 of -0.05*log10(160)*(1 or 2)
    assert c[1].effect == pytest.approx(-0.05 * math.log10(160) * 1.5)
    assert c[2].verdict == F.REPRODUCED
    assert c[2].effect == pytest.approx(-0.05 * (math.log10(160) - 1) * 1.5)
    assert c[3].verdict == F.REPRODUCED and "diverse" in c[3].measured_at
    assert c[3].effect == pytest.approx(-0.05 * math.log10(160))
    assert c[6, "ELS"].verdict == F.REPRODUCED and c[6, "ULS"].verdict == F.REPRODUCED
    # ELS's rule picks G = 8, the best of the sweep: effect 0 and reproduced
    assert c[7].verdict == F.REPRODUCED and c[7].effect == 0
    # ULS's rule picks G = 2, worse than the sweep's best (G = 8) by 0.04 nats > tolerance 0.01
    assert c[8].verdict == F.NOT_REPRODUCED
    assert c[8].effect == pytest.approx(0.04) and "best G = 8" in c[8].detail
    # claim 4 at the smallest budget for the homogeneous corpus: ULS ahead by 0.05 > tolerance 0.01 -> not reproduced
    assert c[4].verdict == F.NOT_REPRODUCED and "homog" in c[4].measured_at


def test_lm_claims_not_reproduced_when_the_data_contradict_them():
    c = run_lm(sign=-1.0)
    for claim in (1, 2, 3):
        assert c[claim].verdict == F.NOT_REPRODUCED, claim
    assert c[4].verdict == F.REPRODUCED  # ELS better everywhere is "competitive or better"


def test_lm_claims_inconclusive_under_seed_noise():
    c = run_lm(noise=(-0.5, 0.0, 0.5))
    for claim in (1, 2, 3):
        assert c[claim].verdict == F.INCONCLUSIVE, claim
        assert c[claim].ci_low < 0 < c[claim].ci_high


def test_lm_claims_not_measured_without_the_axis():
    one = {"homog": lm_summary(study_loss(False), budgets=(1000,))}
    c = by_claim(F.lm_findings(one, {"homog": 3.5}, {"homog": None}, {"epsilon": 1.0, "budget": 1000}, 0.01))
    assert c[2].verdict == F.NOT_MEASURED and "one compute budget" in c[2].detail
    assert c[3].verdict == F.NOT_MEASURED and "diversity" in c[3].detail
    assert c[7].verdict == F.NOT_MEASURED and c[8].verdict == F.NOT_MEASURED  # no sweep
    assert c[1].verdict == F.REPRODUCED


# ---------------------------------------------------------------- accounting and mean estimation
def comparison(ratios, rdp_ratios=None):
    rows = []
    for (eps, g), r in ratios.items():
        rows.append(dict(accountant="els", epsilon=eps, group_size=g, noise_multiplier=1.0 * g))
        rows.append(dict(accountant="group", epsilon=eps, group_size=g, noise_multiplier=r * g))
    for (eps, g), r in (rdp_ratios or {}).items():
        rows.append(dict(accountant="group_rdp", epsilon=eps, group_size=g, noise_multiplier=r * g))
    return pd.DataFrame(rows)


def test_accounting_claim_once_per_group_baseline():
    fs = F.accounting_findings(comparison({(1.0, 4): 1.05, (1.0, 16): 1.3}, {(1.0, 4): 1.2, (1.0, 16): 0.9}))
    assert len(fs) == 2
    pld = next(f for f in fs if "from PLD" in f.detail)
    rdp = next(f for f in fs if "from RDP" in f.detail)
    assert pld.verdict == F.REPRODUCED and pld.effect == pytest.approx(1.05)
    assert rdp.verdict == F.NOT_REPRODUCED and rdp.effect == pytest.approx(0.9) and "RDP" in rdp.unit


def test_accounting_claim_uses_every_g_above_one():
    (f,) = F.accounting_findings(comparison({(1.0, 1): 1.0, (1.0, 4): 1.05, (1.0, 16): 1.3}))
    assert f.verdict == F.REPRODUCED and f.effect == pytest.approx(1.05)
    assert "G 4: 1.050x" in f.detail and "G 16: 1.300x" in f.detail and "G 1:" not in f.detail
    (f,) = F.accounting_findings(comparison({(1.0, 4): 1.0}))
    assert f.verdict == F.NOT_REPRODUCED


def me_results(sign=1.0):
    rows = []
    for m in ("els", "uls"):
        for e in (0.5, 8.0):
            for k in (10000, 160000):
                for d in (0.1, 10.0):
                    for s, n in zip(SEEDS, NOISE):
                        err = 1e-3 * (1.0 if m == "els" else math.exp(-sign * 0.2 * math.log10(k / 1000) * (1 + d / 10)))
                        rule = 8 if m == "els" else 2
                        rows.append(dict(method=m, epsilon=e, compute_budget=k, diversity=d, group_size=rule,
                                         seed=s, squared_error=err * math.exp(n), chosen=True))
                        for g, factor in ((1, 1.5), (rule * 2, 1.02)):
                            rows.append(dict(method=m, epsilon=e, compute_budget=k, diversity=d, group_size=g,
                                             seed=s, squared_error=err * factor * math.exp(n), chosen=False))
    return pd.DataFrame(rows)


def test_mean_estimation_claims():
    c = by_claim(F.me_findings(me_results(), relative_tolerance=0.1), F.ME)
    assert c[1].verdict == F.REPRODUCED and c[2].verdict == F.REPRODUCED and c[3].verdict == F.REPRODUCED
    assert c[6].verdict == F.NOT_MEASURED
    assert c[7].verdict == F.REPRODUCED and c[8].verdict == F.REPRODUCED  # rules' G are the best
    c = by_claim(F.me_findings(me_results(sign=-1.0), relative_tolerance=0.1), F.ME)
    assert c[1].verdict == F.NOT_REPRODUCED and c[3].verdict == F.NOT_REPRODUCED


# ---------------------------------------------------------------- the job: files in, table out
def test_findings_job_writes_json_and_csv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = validate_config({
        "datasets": {"homog": {"source": "synthetic", "synthetic": {"alpha": 0.1}},
                     "diverse": {"source": "synthetic", "synthetic": {"alpha": 10.0}}},
        "grid": {"datasets": ["homog", "diverse"], "epsilons": [1, 8],
                 "budgets": [{"compute": 1000, "steps": 5}, {"compute": 16000, "steps": 5}],
                 "seeds": [0, 1, 2], "group_size_sweep": [1, 8, 32]},
        "findings": {"name": "mystudy"},
    })
    # rule findings' inputs (grid datasets in order; tests/test_rules.py reads them off the DAG)
    inputs = {"summaries": [f"results/summary/{d}/metrics.parquet" for d in ("homog", "diverse")],
              "pretrained": [f"results/runs/{d}/pretrained/metrics.json" for d in ("homog", "diverse")],
              "comparison": "results/accounting/comparison.parquet",
              "mean_estimation": "results/mean_estimation/results.parquet"}
    for d, path, pre in zip(("homog", "diverse"), inputs["summaries"], inputs["pretrained"]):
        write_parquet(path, lm_summary(study_loss(d == "diverse"), sweep=(1, 8, 32)))
        write_json(pre, {"test_loss": 3.5})
    write_parquet(inputs["comparison"], comparison({(1.0, 4): 1.05}))
    write_parquet(inputs["mean_estimation"], me_results())
    out_json, out_csv = "results/findings/mystudy.json", "results/findings/mystudy.csv"
    result = findings_job.run(findings_job.params(config), inputs["summaries"], inputs["pretrained"],
                              inputs["comparison"], inputs["mean_estimation"], out_json, out_csv)
    stored = json.loads((tmp_path / out_json).read_text())
    assert stored["study"] == "mystudy" and stored["counts"] == result["counts"]
    claims = {(f["claim_id"], f["domain"]) for f in stored["findings"]}
    assert {(i, F.LM) for i in (1, 2, 3, 4, 6, 7, 8)} <= claims and (5, F.ACCOUNTING) in claims
    assert {(i, F.ME) for i in (1, 2, 3, 4, 6, 7, 8)} <= claims
    table = pd.read_csv(tmp_path / out_csv)
    assert list(table.columns) == F.TABLE_COLUMNS and len(table) == len(stored["findings"])
    lm3 = [f for f in stored["findings"] if f["claim_id"] == 3 and f["domain"] == F.LM][0]
    assert lm3["verdict"] == F.REPRODUCED and lm3["figure"] == "lm_uls_minus_els"
