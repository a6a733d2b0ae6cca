"""The audit's summary: one row per audited cell (`summary_rows`), whether a bound contradicts its claim
(`bound_exceeds_claim`, `fdp_bound_exceeds_claim`) and the HTML table of the report (`summary_html`, pandas'
own `to_html`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


# ---------------------------------------------------------------- the audit's summary


SUMMARY_COLUMNS = (
    "dataset", "method", "epsilon_target", "epsilon_claimed", "delta", "budget", "steps", "seed", "group_size",
    "noise_multiplier", "sampling_rate", "canaries", "canaries_included", "epsilon_lower_bound",
    "epsilon_lower_bound_ceiling", "confidence",
    "loss_auc", "loss_tpr_at_1pct_fpr", "loss_epsilon_lower_bound", "likelihood_ratio_auc",
    "likelihood_ratio_tpr_at_1pct_fpr", "likelihood_ratio_epsilon_lower_bound", "bound_exceeds_claim",
    # the f-DP estimator next to the (epsilon, delta) one; the canaries; the run's own claim; extraction risk
    "epsilon_lower_bound_fdp", "epsilon_lower_bound_fdp_ceiling", "loss_epsilon_lower_bound_fdp",
    "likelihood_ratio_epsilon_lower_bound_fdp", "canary_design", "prefix_length", "secret_length",
    "epsilon_claimed_run", "delta_run", "exposure_candidates", "exposure_max", "exposure_included_mean",
    "exposure_excluded_mean", "extraction_rate_included", "extraction_rate_excluded",
    "extraction_token_accuracy_included", "fdp_bound_exceeds_claim",
)


#: The columns that are not floats (texts, counts, flags); every other summary column is made a float.
_NOT_FLOAT = ("dataset", "method", "budget", "steps", "seed", "group_size", "canaries", "canaries_included",
              "bound_exceeds_claim", "canary_design", "prefix_length", "secret_length", "exposure_candidates",
              "fdp_bound_exceeds_claim")


def bound_exceeds_claim(result: Mapping) -> bool:
    """Whether the empirical lower bound contradicts the claimed epsilon (a bug in the mechanism or its accounting).

    The (epsilon, delta) bound, which assumes nothing about the mechanism.
    """
    return float(result["epsilon_lower_bound"]) > float(result["epsilon_claimed"])


def fdp_bound_exceeds_claim(result: Mapping) -> bool:
    """Whether the f-DP bound exceeds the claim: a contradiction if the mechanism's trade-off curve is Gaussian.

    DP-SGD's is close to Gaussian after many steps, not exactly, so this is
    a warning to investigate, not the proof `bound_exceeds_claim` gives.
    """
    return float(result.get("epsilon_lower_bound_fdp") or 0.0) > float(result["epsilon_claimed"])


def summary_rows(results: Sequence[Mapping]) -> "pd.DataFrame":
    """One row per audited cell (SUMMARY_COLUMNS), private cells by claimed epsilon, then the references."""
    import pandas as pd

    rows = [{k: r.get(k) for k in SUMMARY_COLUMNS} for r in results]
    df = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    for col in (c for c in SUMMARY_COLUMNS if c not in _NOT_FLOAT):  # JSON writes inf as the string "inf"
        df[col] = [math.nan if v is None else float(v) for v in df[col]]
    for col in ("bound_exceeds_claim", "fdp_bound_exceeds_claim"):
        df[col] = df[col].fillna(False).astype(bool)
    return df.sort_values(["dataset", "method", "epsilon_claimed"], kind="stable").reset_index(drop=True)


def _missing(x) -> bool:
    """True for None and float nan (a summary cell without a value)."""
    return x is None or (isinstance(x, (float, np.floating)) and math.isnan(x))


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    return "∞" if math.isinf(x) else f"{x:.{digits}g}"


def summary_html(df: "pd.DataFrame", dataset: str) -> str:
    """The audit table of the HTML report: one row per audited cell, claimed next to empirical epsilon."""
    import html

    cols = [("method", "method"), ("epsilon_claimed", "claimed ε (run ledger)"),
            ("epsilon_lower_bound", "empirical ε lower bound (95%, (ε, δ) one-run)"),
            ("epsilon_lower_bound_ceiling", "largest bound possible ((ε, δ))"),
            ("epsilon_lower_bound_fdp", "empirical ε lower bound (95%, Gaussian f-DP)"),
            ("epsilon_lower_bound_fdp_ceiling", "largest bound possible (f-DP)"), ("loss_auc", "AUC (loss)"),
            ("likelihood_ratio_auc", "AUC (likelihood ratio)"), ("loss_tpr_at_1pct_fpr", "TPR @ 1% FPR (loss)"),
            ("likelihood_ratio_tpr_at_1pct_fpr", "TPR @ 1% FPR (LR)"),
            ("exposure_included_mean", "exposure, bits (in)"), ("exposure_excluded_mean", "exposure, bits (out)"),
            ("extraction_rate_included", "secrets extracted (in)"),
            ("extraction_rate_excluded", "secrets extracted (out)"), ("canaries_included", "canaries in"),
            ("canaries", "canaries"), ("group_size", "G"), ("noise_multiplier", "σ"), ("delta", "δ"),
            ("bound_exceeds_claim", "bound > claim")]
    import pandas as pd

    shown = pd.DataFrame({label: [str(v).upper() if key == "method" else _fmt(v) for v in df[key]]
                          for key, label in cols})
    table = shown.to_html(index=False, border=0, escape=True)
    design = ", ".join(sorted({str(x) for x in df["canary_design"].dropna()})) or "–"
    ceiling = ""
    if len(df):
        r = df.iloc[0]
        ceiling = (f"<p>Before training, this audit could show at most ε = {_fmt(r['epsilon_lower_bound_ceiling'])} "
                   f"with the (ε, δ) one-run bound and ε = {_fmt(r['epsilon_lower_bound_fdp_ceiling'])} with the "
                   f"f-DP bound ({int(r['canaries'])} canaries, δ = {_fmt(r['delta'])}, "
                   f"{_fmt(100 * r['confidence'])}% confidence): a cell at its ceiling leaked at least that much, "
                   "and may have leaked more.</p>\n")
    risk = "; ".join(
        f"{str(r['method']).upper()} ε {_fmt(r['epsilon_claimed'])}: {_fmt(r['exposure_included_mean'])} bits "
        f"(chance {_fmt(r['exposure_excluded_mean'])}), {_fmt(100 * r['extraction_rate_included'])}% extracted"
        for _, r in df.iterrows() if not _missing(r.get("extraction_rate_included")))
    if risk:
        ceiling += f"<p>Extraction risk (mean exposure of the included canaries; secrets greedy decoding " \
                   f"returns): {html.escape(risk)}.</p>\n"
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>User-level membership audit: "
        f"{html.escape(dataset)}</title><style>table{{border-collapse:collapse;font-family:sans-serif}}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:right}th{background:#eee}</style></head><body>\n"
        f"<h3>User-level membership audit of {html.escape(dataset)}</h3>\n"
        "<p>Each row is one audited cell: a model trained with the cell's plan on the dataset plus the canary "
        f"users ({html.escape(design)} canaries) that won their coin (probability 1/2). The empirical ε are 95% "
        "lower bounds from one run, users as the unit: the (ε, δ) bound of Steinke, Nasr and Jagielski 2023, "
        "which assumes nothing about the mechanism, and the f-DP bound of Mahloujifar et al. 2025, which assumes "
        "a Gaussian trade-off curve (as DP-SGD's nearly is); the claimed ε is the run ledger's, at the same δ. A "
        "lower bound above the claim would reveal a bug; a bound below it proves nothing (docs/audits.md). "
        "Exposure (bits, Carlini et al. 2019) ranks each secret among sampled candidates; extracted: greedy "
        "decoding from the canary's prefix returns its secret.</p>\n" + ceiling
        + table + "\n</body></html>\n"
    )
