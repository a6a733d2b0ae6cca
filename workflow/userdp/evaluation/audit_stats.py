"""The statistics of the user-level membership audit (docs/audits.md): the one-run (epsilon, delta) bound of
Steinke, Nasr and Jagielski 2023 (`epsilon_lower_bound`, its `p_value`), the Gaussian f-DP one-run bound of
Mahloujifar, Melis and Chaudhuri 2025 (`epsilon_lower_bound_fdp`), the guess sets they are evaluated on, and
the ROC summaries (`auc`, `tpr_at_fpr`). Numbers in, numbers out: no model, no file (userdp.evaluation.audit
scores a model with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import scipy.stats

#: The membership scores (userdp.evaluation.audit.membership_scores); every guess set is tried on each.
SCORES = ("loss", "likelihood_ratio")
FPR_TARGET = 0.01


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
    # the cap cannot be reached for r >= 1 (p -> 1 as epsilon grows); it guards against a bad input
    return _largest_rejected(lambda eps: p_value(m, r, v, eps, delta) < level, 1e4, tol)


def _largest_rejected(rejects: Callable[[float], bool], cap: float, tol: float) -> float:
    """The largest epsilon that `rejects` (which holds at 0 and flips once), rounded down to `tol`: the bracket
    doubles from [0, 1] (giving up at `cap`), then a bisection."""
    lo, hi = 0.0, 1.0
    while rejects(hi):
        lo, hi = hi, 2.0 * hi
        if hi > cap:
            return lo
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if rejects(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------- the f-DP (Gaussian) one-run bound


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-GDP (the Gaussian mechanism with sensitivity mu and unit noise).

    Dong, Roth and Su 2022, Corollary 2.13: Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), in logs.
    """
    if mu <= 0:
        return 0.0
    a = scipy.special.log_ndtr(-epsilon / mu + mu / 2)
    b = epsilon + scipy.special.log_ndtr(-epsilon / mu - mu / 2)
    return float(math.exp(a) * -math.expm1(b - a)) if b < a else 0.0


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu of the Gaussian mechanism that is exactly (epsilon, delta)-DP (gdp_delta grows with mu)."""
    if not 0 < delta < 1 or epsilon < 0:
        raise ValueError(f"need epsilon >= 0 and 0 < delta < 1, got {epsilon}, {delta}")
    lo, hi = 0.0, 1.0
    while gdp_delta(hi, epsilon) < delta:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gdp_delta(mid, epsilon) < delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


def fdp_rejects(mu: float, m: int, r: int, v: int, level: float) -> bool:
    """Whether v correct guesses of r (m canaries) reject "the training is mu-GDP for each canary" at `level`.

    The guessing-game bound of Mahloujifar, Melis and Chaudhuri 2025
    ("Auditing f-Differential Privacy in One Run", Algorithm 3 with the
    trade-off function of mu-GDP): starting from the tail masses
    r_v = level v / m (correct) and h_v = level (r - v) / m (wrong), each
    step down to i correct guesses raises the wrong-guess mass to at least
    what the trade-off curve forces, h' = max(h, Phi(Phi^-1(r) - mu)), and
    moves the correct-guess mass by i / (r - i) of the change. The claim is
    rejected when the two masses together exceed r / m, the fraction of
    canaries guessed: no mu-GDP mechanism then makes >= v correct guesses
    with probability above `level`.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    correct, wrong = level * v / m, level * (r - v) / m
    for i in range(v - 1, -1, -1):
        forced = float(scipy.special.ndtr(scipy.special.ndtri(correct) - mu)) if correct < 1 else 1.0
        if forced <= wrong:  # nothing changes any more
            break
        correct = min(correct + i / (r - i) * (forced - wrong), 1.0)
        wrong = forced
    return correct + wrong > r / m


def epsilon_lower_bound_fdp(m: int, r: int, v: int, delta: float, level: float = 0.05, tol: float = 1e-6) -> float:
    """The largest epsilon such that "mu(epsilon, delta)-GDP for each canary" is rejected at `level` (0 if none).

    mu(epsilon, delta) (`gdp_mu`) is the Gaussian mechanism whose privacy
    curve passes through (epsilon, delta); the bound is the epsilon, at
    delta, of the most private Gaussian trade-off curve the guesses rule out.
    It assumes the mechanism's trade-off curve is Gaussian-shaped (DP-SGD's
    is close to it after many steps), which the (epsilon, delta) bound of
    `epsilon_lower_bound` does not; there is no 2 m delta term. A
    bisection, rounded down.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if v == 0 or not fdp_rejects(gdp_mu(0.0, delta), m, r, v, level):
        return 0.0
    return _largest_rejected(lambda eps: fdp_rejects(gdp_mu(eps, delta), m, r, v, level), 1e3, tol)


#: The one-run estimators: result-key suffix -> the bound of v correct guesses of r.
ESTIMATORS = {"": epsilon_lower_bound, "_fdp": epsilon_lower_bound_fdp}


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


def auc(scores: np.ndarray, included: np.ndarray) -> float | np.ndarray:
    """ROC AUC: P(score of an included canary > score of an excluded one), ties counting 1/2 (the Mann-Whitney
    statistic from average ranks). 2-D `scores` and `included`: the AUC of each row (bootstrap resamples of the
    canaries), as an array; 1-D: a float, nan without an included or an excluded canary."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    n_in = included.sum(axis=-1)
    n_out = included.shape[-1] - n_in
    if scores.ndim == 1 and (n_in == 0 or n_out == 0):
        return math.nan
    ranks = scipy.stats.rankdata(scores, axis=-1)  # average ranks for ties
    out = ((ranks * included).sum(axis=-1) - n_in * (n_in + 1) / 2) / (n_in * n_out)
    return float(out) if scores.ndim == 1 else out


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
