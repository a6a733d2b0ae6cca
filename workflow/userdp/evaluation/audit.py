"""The user-level membership audit of a trained model (docs/privacy.md, "Auditing the released model").

Canary users (`userdp.data.canaries`) were each included in training with
probability 1/2. Here every canary gets a membership score from the audited
model, higher meaning "more likely trained on":

* `loss`: minus the model's mean next-token loss on the canary's example;
* `likelihood_ratio`: the reference model's loss minus the audited model's
  (the reference, the pretrained base model, never saw a canary), which
  removes how hard a canary's random secret is for any model.

From the scores and the true coins: the ROC AUC, the TPR at 1% FPR, and the
empirical user-level epsilon lower bound of the one-run audit (Steinke, Nasr
and Jagielski 2023, "Privacy Auditing with One (1) Training Run": their
bound for (eps, delta)-DP, as their Appendix D computes it): the auditor guesses "in" for the k+
highest-scored canaries and "out" for the k- lowest, abstaining on the rest;
if the training algorithm is (eps, delta)-DP for each canary, the number W of
correct guesses among r = k+ + k- satisfies

    P[W >= v] <= P[Binomial(r, p_eps) >= v] + 2 m delta max_{i=1..v} P[v - i <= Binomial(r, p_eps) < v] / i,

p_eps = e^eps / (1 + e^eps), m canaries. The lower bound is the largest eps
whose bound on the p-value of the observed v is below 1 - confidence. The
audit tries several guess sets (`GuessSet`: every guess count of
`audit.guess_fractions`, one-sided and two-sided, for both scores) and
divides 1 - confidence by their number (Bonferroni), so the largest bound
over all of them holds at the stated confidence. A lower bound is evidence
of leakage, never a proof of privacy: an audit that finds nothing says only
that these canaries and these scores did not reveal more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import scipy.stats

SCORES = ("loss", "likelihood_ratio")
FPR_TARGET = 0.01
#: Guess-set sides: "in" only (the k highest scores), or half "in" (highest) and half "out" (lowest).
SIDES = ("top", "both")


# ---------------------------------------------------------------- the one-run bound


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[W >= v] for r guesses on m canaries of an (epsilon, delta)-DP algorithm.

    Steinke et al. 2023 (the (eps, delta) bound their Appendix D computes):
    the binomial tail of an epsilon-DP randomized response plus the delta term.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
    beta = float(scipy.stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    alpha = 0.0
    if delta > 0 and v > 0:
        # P[v - i <= Binomial < v] / i for i = 1..v: cumulative pmf of v-1, v-2, ..., 0
        below = np.cumsum(scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
        alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(beta + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, level: float = 0.05, tol: float = 1e-6) -> float:
    """The largest epsilon whose p-value bound for v correct guesses of r is below `level` (0 if none).

    p_value increases with epsilon, so this is a bisection; the bound is
    rounded down (to `tol`), so it never overstates the evidence.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < level:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:  # cannot happen for r >= 1 (p -> 1 as epsilon grows); guard against a bad input
            return lo
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < level:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class GuessSet:
    """One way to guess: `n_in` highest scores guessed "in", `n_out` lowest guessed "out", by `score`."""

    score: str
    side: str
    n_in: int
    n_out: int

    @property
    def guesses(self) -> int:
        return self.n_in + self.n_out


def guess_sets(m: int, fractions: Sequence[float]) -> list[GuessSet]:
    """Every guess set the audit tries: for each score and guess count round(f m), one-sided and two-sided."""
    counts = sorted({max(1, min(m, int(round(f * m)))) for f in fractions})
    out = []
    for score in SCORES:
        for r in counts:
            out.append(GuessSet(score, "top", r, 0))
            if r >= 2:
                out.append(GuessSet(score, "both", r // 2, r - r // 2))
    return out


def correct_guesses(scores: np.ndarray, included: np.ndarray, n_in: int, n_out: int) -> int:
    """Correct guesses when the n_in highest scores are guessed in and the n_out lowest out.

    Ties are broken by a fixed order (the canary index), never by membership.
    """
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    if n_in + n_out > len(scores):
        raise ValueError(f"{n_in} + {n_out} guesses for {len(scores)} canaries")
    order = np.lexsort((np.arange(len(scores)), scores))  # ascending score, then index
    top = order[len(order) - n_in:] if n_in else order[:0]
    bottom = order[:n_out]
    return int(included[top].sum() + (~included[bottom]).sum())


# ---------------------------------------------------------------- ROC summaries


def auc(scores: np.ndarray, included: np.ndarray) -> float:
    """ROC AUC: P(score of an included canary > score of an excluded one), ties counting 1/2."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    n_in, n_out = int(included.sum()), int((~included).sum())
    if n_in == 0 or n_out == 0:
        return math.nan
    ranks = scipy.stats.rankdata(scores)  # average ranks for ties
    return float((ranks[included].sum() - n_in * (n_in + 1) / 2) / (n_in * n_out))


def tpr_at_fpr(scores: np.ndarray, included: np.ndarray, fpr: float = FPR_TARGET) -> float:
    """The largest true-positive rate of a threshold rule (score >= t is "in") whose false-positive rate is <= fpr."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    n_in, n_out = int(included.sum()), int((~included).sum())
    if n_in == 0 or n_out == 0:
        return math.nan
    best = 0.0
    for t in np.unique(scores):
        pred = scores >= t
        if (pred & ~included).sum() / n_out <= fpr:
            best = max(best, float((pred & included).sum() / n_in))
    return best


# ---------------------------------------------------------------- one audited model


def membership_scores(loss: np.ndarray, reference_loss: np.ndarray) -> dict[str, np.ndarray]:
    """The scores of SCORES from per-canary losses (higher = more likely included)."""
    loss, reference_loss = np.asarray(loss, float), np.asarray(reference_loss, float)
    return {"loss": -loss, "likelihood_ratio": reference_loss - loss}


def audit_result(scores: Mapping[str, np.ndarray], included: np.ndarray, *, delta: float,
                 confidence: float = 0.95, guess_fractions: Iterable[float] = (0.05, 0.1, 0.2, 0.5)) -> dict:
    """AUC, TPR at 1% FPR and the epsilon lower bound of each score, and the audit's headline bound.

    Every guess set is tested at level (1 - confidence) / (number of guess
    sets), so `epsilon_lower_bound`, the largest over all of them, holds at
    `confidence`.
    """
    included = np.asarray(included, bool)
    m = int(included.size)
    sets = guess_sets(m, list(guess_fractions))
    level = (1.0 - confidence) / len(sets)
    tried = []
    for gs in sets:
        v = correct_guesses(scores[gs.score], included, gs.n_in, gs.n_out)
        eps = epsilon_lower_bound(m, gs.guesses, v, delta, level)
        tried.append({"score": gs.score, "side": gs.side, "guesses_in": gs.n_in, "guesses_out": gs.n_out,
                      "correct": v, "epsilon_lower_bound": eps})
    best = max(tried, key=lambda t: t["epsilon_lower_bound"])
    out = {
        "canaries": m,
        "canaries_included": int(included.sum()),
        "confidence": confidence,
        "level_per_guess_set": level,
        "delta": delta,
        # The most this audit could show: every guess of the best guess set right. With few canaries, a
        # strict level or a large delta (the bound's delta term grows with 2 m delta) it is small or 0.
        "epsilon_lower_bound_ceiling": max(epsilon_lower_bound(m, gs.guesses, gs.guesses, delta, level)
                                           for gs in sets),
        "epsilon_lower_bound": best["epsilon_lower_bound"],
        "best_guess_set": best,
        "guess_sets": tried,
    }
    for name in SCORES:
        out[f"{name}_auc"] = auc(scores[name], included)
        out[f"{name}_tpr_at_1pct_fpr"] = tpr_at_fpr(scores[name], included)
        out[f"{name}_epsilon_lower_bound"] = max(t["epsilon_lower_bound"] for t in tried if t["score"] == name)
    return out


def canary_losses(model, sequences: Sequence[np.ndarray], batch_size: int, device) -> np.ndarray:
    """Mean next-token loss of `model` on each canary's sequence (userdp.evaluation.metrics.sequence_scores)."""
    from .metrics import sequence_scores

    nll, _, n_targets = sequence_scores(model, sequences, batch_size, device)
    return nll / np.maximum(n_targets, 1)


def claimed_epsilon(ledger: Mapping) -> float:
    """The guarantee of the audited model: its run ledger's `epsilon` (one run, no learning-rate selection).

    The audited model is the output of exactly one run, so the epsilon of the
    steps that ran (plus any DP statistics release, which the ledger composes
    in) is its whole guarantee; inf for the non-private reference.
    """
    eps = ledger.get("epsilon")
    if eps is None:
        raise ValueError("the run ledger has no epsilon; rebuild the audited run")
    return float(eps)


def audit_cell(*, dataset: str, model: str, reference: str, local_reference: bool, ledger: Mapping, canaries: str,
               scores_out: str, result_out: str, confidence: float, guess_fractions: Sequence[float],
               batch_size: int, device: str = "auto") -> dict:
    """Score every canary with the audited model and the reference, write the scores and the cell's result.

    scores_out (Parquet): per canary `user_id`, `included`, `loss`,
    `reference_loss` and `score_<name>` for each of SCORES; result_out (JSON): the cell (method,
    target and claimed epsilon, delta, G, sigma, q, T, K) and `audit_result`.
    """
    import pandas as pd

    from ..data.canaries import read_canaries
    from ..io import write_json, write_parquet
    from ..training.models import load_model, resolve_device

    table = read_canaries(canaries)
    sequences = [np.asarray(s, dtype=np.int64) for s in table["input_ids"].to_pylist()]
    included = np.asarray(table["included"].to_pylist(), bool)
    dev = resolve_device(device)
    losses = {}
    for name, path, local in (("loss", model, True), ("reference_loss", reference, local_reference)):
        net = load_model(path, dev, local=local).eval()
        losses[name] = canary_losses(net, sequences, batch_size, dev)
        del net
    scores = membership_scores(losses["loss"], losses["reference_loss"])
    frame = pd.DataFrame({"user_id": table["user_id"].to_pylist(), "included": included, **losses,
                          **{f"score_{k}": v for k, v in scores.items()}})
    delta = float(ledger["delta"])
    result = {
        "dataset": dataset,
        "method": ledger["method"],
        "epsilon_target": float(ledger["epsilon_planned"]),
        "epsilon_claimed": claimed_epsilon(ledger),
        "budget": ledger.get("compute_budget"),
        "steps": ledger.get("steps_completed"),
        "seed": ledger.get("seed"),
        "group_size": ledger.get("group_size"),
        "noise_multiplier": ledger.get("noise_multiplier"),
        "sampling_rate": ledger.get("sampling_rate"),
        "learning_rate": ledger.get("learning_rate"),
        "model": str(model),
        "reference_model": str(reference),
        **audit_result(scores, included, delta=delta, confidence=confidence, guess_fractions=guess_fractions),
        "mean_loss_included": float(losses["loss"][included].mean()) if included.any() else math.nan,
        "mean_loss_excluded": float(losses["loss"][~included].mean()) if (~included).any() else math.nan,
    }
    result["bound_exceeds_claim"] = bound_exceeds_claim(result)
    write_parquet(scores_out, frame)
    write_json(result_out, result)
    return result


# ---------------------------------------------------------------- the audit's summary


SUMMARY_COLUMNS = (
    "dataset", "method", "epsilon_target", "epsilon_claimed", "delta", "budget", "steps", "seed", "group_size",
    "noise_multiplier", "sampling_rate", "canaries", "canaries_included", "epsilon_lower_bound",
    "epsilon_lower_bound_ceiling", "confidence",
    "loss_auc", "loss_tpr_at_1pct_fpr", "loss_epsilon_lower_bound", "likelihood_ratio_auc",
    "likelihood_ratio_tpr_at_1pct_fpr", "likelihood_ratio_epsilon_lower_bound", "bound_exceeds_claim",
)


_FLOAT_COLUMNS = ("epsilon_target", "epsilon_claimed", "delta", "noise_multiplier", "sampling_rate",
                  "epsilon_lower_bound", "epsilon_lower_bound_ceiling", "confidence", "loss_auc",
                  "loss_tpr_at_1pct_fpr", "loss_epsilon_lower_bound",
                  "likelihood_ratio_auc", "likelihood_ratio_tpr_at_1pct_fpr", "likelihood_ratio_epsilon_lower_bound")


def bound_exceeds_claim(result: Mapping) -> bool:
    """Whether the empirical lower bound contradicts the claimed epsilon (a bug in the mechanism or its accounting)."""
    return float(result["epsilon_lower_bound"]) > float(result["epsilon_claimed"])


def summary_rows(results: Sequence[Mapping]) -> "pd.DataFrame":
    """One row per audited cell (SUMMARY_COLUMNS), private cells by claimed epsilon, then the references."""
    import pandas as pd

    rows = [{k: r.get(k) for k in SUMMARY_COLUMNS} for r in results]
    df = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    for col in _FLOAT_COLUMNS:  # JSON writes inf as the string "inf"
        df[col] = [math.nan if v is None else float(v) for v in df[col]]
    df["bound_exceeds_claim"] = df["bound_exceeds_claim"].astype(bool)
    return df.sort_values(["dataset", "method", "epsilon_claimed"], kind="stable").reset_index(drop=True)


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
            ("epsilon_lower_bound", "empirical ε lower bound (95%)"),
            ("epsilon_lower_bound_ceiling", "largest bound possible"), ("loss_auc", "AUC (loss)"),
            ("likelihood_ratio_auc", "AUC (likelihood ratio)"), ("loss_tpr_at_1pct_fpr", "TPR @ 1% FPR (loss)"),
            ("likelihood_ratio_tpr_at_1pct_fpr", "TPR @ 1% FPR (LR)"), ("canaries_included", "canaries in"),
            ("canaries", "canaries"), ("group_size", "G"), ("noise_multiplier", "σ"), ("delta", "δ"),
            ("bound_exceeds_claim", "bound > claim")]
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in cols)
    body = []
    for _, row in df.iterrows():
        cells = []
        for key, _ in cols:
            v = row[key]
            text = str(v).upper() if key == "method" else _fmt(v)
            cells.append(f"<td>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>User-level membership audit: "
        f"{html.escape(dataset)}</title><style>table{{border-collapse:collapse;font-family:sans-serif}}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:right}th{background:#eee}</style></head><body>\n"
        f"<h3>User-level membership audit of {html.escape(dataset)}</h3>\n"
        "<p>Each row is one audited cell: a model trained with the cell's plan on the dataset plus the canary "
        "users that won their coin (probability 1/2). The empirical ε is a 95% lower bound (one-run audit, "
        "Steinke, Nasr and Jagielski 2023, users as the unit); the claimed ε is the run ledger's. A lower bound "
        "above the claim would reveal a bug; a bound below it proves nothing (docs/privacy.md).</p>\n"
        f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table>\n</body></html>\n"
    )
