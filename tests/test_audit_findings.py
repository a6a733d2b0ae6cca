"""Claim 9 of the findings table: at equal claimed epsilon, does ELS leak more than ULS (the black-box audit)?"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from userdp.evaluation import audit_stats, findings, findings_job
from userdp.io import write_json, write_parquet
from userdp.layout import fmt_num


def _cell(rng, included, separation: float, method: str, eps, dataset="d") -> tuple[dict, pd.DataFrame]:
    score = separation * included + rng.normal(size=included.size)
    frame = pd.DataFrame({"user_id": [f"canary-{i:05d}" for i in range(included.size)], "included": included,
                          "score_loss": score, "score_likelihood_ratio": score})
    res = {"dataset": dataset, "method": method, "epsilon_target": eps, "epsilon_claimed": eps,
           "canary_design": "new_token", "epsilon_lower_bound": 0.0, "epsilon_lower_bound_fdp": 0.0,
           "loss_auc": audit_stats.auc(score, included), "likelihood_ratio_auc": audit_stats.auc(score, included)}
    return res, frame


def _audit(sep_els: float, sep_uls: float, epsilons=(1.0, 8.0), m=400, seed=0):
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    results, scores = [], {}
    for eps in epsilons:
        for method, sep in (("els", sep_els), ("uls", sep_uls)):
            res, frame = _cell(rng, included, sep, method, eps)
            results.append(res)
            scores[("d", method, fmt_num(eps))] = frame  # as findings_job keys them
    return results, scores


@pytest.mark.parametrize("sep_els,sep_uls,expected", [
    (1.5, 0.0, findings.REPRODUCED), (0.0, 1.5, findings.NOT_REPRODUCED), (0.3, 0.3, findings.INCONCLUSIVE)])
def test_claim_9_verdict_follows_the_paired_interval(sep_els, sep_uls, expected):
    results, scores = _audit(sep_els, sep_uls)
    (f,) = findings.audit_findings(results, scores)
    assert f.claim_id == 9 and f.domain == findings.AUDIT and f.verdict == expected
    assert f.ci_low <= f.effect <= f.ci_high
    # the effect is the mean over epsilons of ELS AUC - ULS AUC
    auc = {(r["method"], r["epsilon_target"]): r["loss_auc"] for r in results}
    want = np.mean([auc[("els", e)] - auc[("uls", e)] for e in (1.0, 8.0)])
    assert f.effect == pytest.approx(want)
    assert "eps 1" in f.detail and "eps 8" in f.detail and "paired bootstrap" in f.detail


def test_claim_9_finds_the_scores_of_an_epsilon_that_general_format_would_round():
    # the score files are keyed by the path text of the epsilon (layout.fmt_num: "0.1234567", "2500000"), which
    # "{:g}" writes as 0.123457 and 2.5e+06
    results, scores = _audit(1.5, 0.0, epsilons=(0.1234567, 2.5e6))
    (f,) = findings.audit_findings(results, scores)
    assert f.verdict == findings.REPRODUCED


def test_claim_9_interval_narrows_with_more_canaries():
    widths = []
    for m in (100, 1600):
        results, scores = _audit(0.5, 0.5, m=m, seed=1)
        (f,) = findings.audit_findings(results, scores)
        widths.append(f.ci_high - f.ci_low)
    assert widths[1] < 0.5 * widths[0]


def test_claim_9_is_not_measured_without_pairs_and_refuses_mismatched_canaries():
    results, scores = _audit(1.0, 0.0, epsilons=(1.0,))
    only_els = [r for r in results if r["method"] == "els"]
    (f,) = findings.audit_findings(only_els, scores)
    assert f.verdict == findings.NOT_MEASURED and f.effect is None
    # references (eps = inf) are not a pair at equal claimed epsilon
    ref = [{**r, "epsilon_target": "inf"} for r in results]
    assert findings.audit_findings(ref, scores)[0].verdict == findings.NOT_MEASURED
    bad = dict(scores)
    bad[("d", "uls", "1")] = bad[("d", "uls", "1")].iloc[:-1]
    with pytest.raises(ValueError, match="different canaries"):
        findings.audit_findings(results, bad)


def test_findings_job_reads_the_audit_only_when_asked(tmp_path):
    off = findings_job.audit_rows({"settings": {"audit": False}, "audit_cells": []}, [], [])
    assert len(off) == 1 and off[0].verdict == findings.NOT_MEASURED and "findings.audit" in off[0].detail
    results, scores = _audit(1.5, 0.0)
    cells, res_files, score_files = [], [], []
    for i, r in enumerate(results):
        cell = [r["dataset"], r["method"], fmt_num(r["epsilon_target"])]  # as findings_job.params writes them
        cells.append(cell)
        write_json(tmp_path / f"r{i}.json", r)
        write_parquet(tmp_path / f"s{i}.parquet", scores[tuple(cell)])
        res_files.append(str(tmp_path / f"r{i}.json"))
        score_files.append(str(tmp_path / f"s{i}.parquet"))
    (f,) = findings_job.audit_rows({"settings": {"audit": True}, "audit_cells": cells}, res_files, score_files)
    assert f.verdict == findings.REPRODUCED
    table = findings.build({}, {}, {}, {"epsilon": 1, "budget": 1}, None, None, 0.01, 0.1, "t", audit=[f])
    assert table["findings"][-1]["claim_id"] == 9 and table["counts"][findings.REPRODUCED] >= 1


def test_findings_params_follow_findings_audit():
    """The audited cells in the params, in the order of grid.audit_cells (rule findings lists their files in the
    same order: tests/test_rules.py)."""
    from userdp.config import validate_config
    from userdp.grid import audit_cells

    base = {"datasets": {"d": {"source": "synthetic"}}, "grid": {"datasets": ["d"]}}
    assert findings_job.params(validate_config({**base}))["audit_cells"] == []
    cfg = validate_config({**base, "findings": {"audit": True}})
    cells = findings_job.params(cfg)["audit_cells"]
    assert cells == [[c.dataset, c.method, fmt_num(c.epsilon)] for c in audit_cells(cfg)]
    assert len(cells) == 4  # els, uls x (8, inf)
