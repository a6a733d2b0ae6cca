"""The user-level membership audit of a trained model (docs/privacy.md, "Auditing the released model").

Canary users (`userdp.data.canaries`) were each included in training with
probability 1/2. Here every canary gets a membership score from the audited
model, higher meaning "more likely trained on":

* `loss`: minus the model's mean next-token loss on the canary's secret
  tokens, given bos + its prefix (`secret_nll`; Panda et al. 2025 score the
  canary's own tokens only);
* `likelihood_ratio`: the reference model's loss minus the audited model's
  (the reference, the pretrained base model, never saw a canary), which
  removes how hard a canary's secret is for any model.

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
over all of them holds at the stated confidence. Next to it, on the same
guesses, the f-DP one-run bound of Mahloujifar, Melis and Chaudhuri 2025
with the Gaussian trade-off curve (`epsilon_lower_bound_fdp`: tighter, no
2 m delta term, but it assumes the mechanism's trade-off curve is Gaussian),
and both bounds' ceilings (`ceilings`: what all-correct guesses give, known
before training). Extraction risk: the exposure of each secret among
sampled candidates (Carlini et al. 2019, `exposure`) and greedy decoding
from the canary's prefix (`greedy_continuations`). A lower bound is evidence
of leakage, never a proof of privacy: an audit that finds nothing says only
that these canaries and these scores did not reveal more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np
import scipy.stats

if TYPE_CHECKING:
    import pandas as pd

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


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at delta (0 when delta(0) <= delta); gdp_delta falls with epsilon."""
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gdp_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(hi, 1.0):
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
    lo, hi = 0.0, 1.0
    while fdp_rejects(gdp_mu(hi, delta), m, r, v, level):
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:
            return lo
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if fdp_rejects(gdp_mu(mid, delta), m, r, v, level):
            lo = mid
        else:
            hi = mid
    return lo


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


def ceilings(m: int, delta: float, confidence: float = 0.95,
             guess_fractions: Iterable[float] = (0.05, 0.1, 0.2, 0.5)) -> dict[str, float]:
    """The most each estimator can show (every guess of the best guess set right), known before training.

    It depends only on the canary count m, delta, the confidence and the
    guess sets: keys `epsilon_lower_bound_ceiling` and
    `epsilon_lower_bound_fdp_ceiling`.
    """
    sets = guess_sets(m, list(guess_fractions))
    level = (1.0 - confidence) / len(sets)
    return {f"epsilon_lower_bound{key}_ceiling": max(bound(m, r, r, delta, level) for r in {gs.guesses for gs in sets})
            for key, bound in ESTIMATORS.items()}


def audit_result(scores: Mapping[str, np.ndarray], included: np.ndarray, *, delta: float,
                 confidence: float = 0.95, guess_fractions: Iterable[float] = (0.05, 0.1, 0.2, 0.5)) -> dict:
    """AUC, TPR at 1% FPR and the epsilon lower bounds of each score, and the audit's headline bounds.

    Every guess set is tested at level (1 - confidence) / (number of guess
    sets), so `epsilon_lower_bound` (the (epsilon, delta) one-run bound of
    Steinke et al.) and `epsilon_lower_bound_fdp` (the Gaussian f-DP one of
    Mahloujifar et al.), each the largest over all guess sets, hold at
    `confidence` (each on its own; the two use the same guesses).
    """
    included = np.asarray(included, bool)
    m = int(included.size)
    fractions = list(guess_fractions)
    sets = guess_sets(m, fractions)
    level = (1.0 - confidence) / len(sets)
    tried = []
    for gs in sets:
        v = correct_guesses(scores[gs.score], included, gs.n_in, gs.n_out)
        row = {"score": gs.score, "side": gs.side, "guesses_in": gs.n_in, "guesses_out": gs.n_out, "correct": v}
        for key, bound in ESTIMATORS.items():
            row[f"epsilon_lower_bound{key}"] = bound(m, gs.guesses, v, delta, level)
        tried.append(row)
    best = max(tried, key=lambda t: t["epsilon_lower_bound"])
    out = {
        "canaries": m,
        "canaries_included": int(included.sum()),
        "confidence": confidence,
        "level_per_guess_set": level,
        "delta": delta,
        # The most this audit could show: every guess of the best guess set right. With few canaries, a
        # strict level or a large delta (the (eps, delta) bound's delta term grows with 2 m delta) it is small or 0.
        **ceilings(m, delta, confidence, fractions),
        "epsilon_lower_bound": best["epsilon_lower_bound"],
        "epsilon_lower_bound_fdp": max(t["epsilon_lower_bound_fdp"] for t in tried),
        "best_guess_set": best,
        "guess_sets": tried,
    }
    for name in SCORES:
        out[f"{name}_auc"] = auc(scores[name], included)
        out[f"{name}_tpr_at_1pct_fpr"] = tpr_at_fpr(scores[name], included)
        for key in ESTIMATORS:
            out[f"{name}_epsilon_lower_bound{key}"] = max(t[f"epsilon_lower_bound{key}"] for t in tried
                                                          if t["score"] == name)
    return out


def secret_nll(model, prefixes: np.ndarray, secrets: np.ndarray, bos: int, batch_size: int, device) -> np.ndarray:
    """Per row, the summed next-token loss of `model` on the secret tokens only, given bos + prefix.

    `prefixes` (n, p) and `secrets` (n, L) are token ids; the loss counts
    the L predictions of the secret (not the prefix, not eos): the canary's
    own tokens, as Panda et al. 2025 score them.
    """
    import torch
    import torch.nn.functional as F

    prefixes, secrets = np.asarray(prefixes, np.int64), np.asarray(secrets, np.int64)
    n, p, length = secrets.shape[0], prefixes.shape[1], secrets.shape[1]
    ids = np.concatenate([np.full((n, 1), int(bos), np.int64), prefixes, secrets], axis=1)
    out = np.zeros(n, dtype=np.float64)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            x = torch.from_numpy(ids[start:start + batch_size]).to(device)
            logits = model(input_ids=x).logits[:, p:p + length].float()  # predictions of the secret's tokens
            target = x[:, p + 1:p + 1 + length]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
            out[start:start + len(x)] = nll.view(target.shape).double().sum(dim=1).cpu().numpy()
    return out


def greedy_continuations(model, prefixes: np.ndarray, length: int, bos: int, batch_size: int, device) -> np.ndarray:
    """`length` tokens greedily decoded (argmax, no sampling) after bos + each row's prefix."""
    import torch

    prefixes = np.asarray(prefixes, np.int64)
    n = prefixes.shape[0]
    out = np.zeros((n, length), dtype=np.int64)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            rows = prefixes[start:start + batch_size]
            x = torch.from_numpy(np.concatenate([np.full((len(rows), 1), int(bos), np.int64), rows], axis=1)).to(device)
            for _ in range(length):
                nxt = model(input_ids=x).logits[:, -1].argmax(dim=-1, keepdim=True)
                x = torch.cat([x, nxt], dim=1)
            out[start:start + len(rows)] = x[:, -length:].cpu().numpy()
    return out


def exposure(secret_loss: np.ndarray, candidate_loss: np.ndarray) -> np.ndarray:
    """Exposure in bits (Carlini et al. 2019, "The Secret Sharer"), estimated from sampled candidates.

    Exposure is log2 |R| - log2 rank, the rank of the true secret among all
    |R| secrets of its space ordered by the model's loss. The space is too
    large to enumerate, so rank / |R| is estimated by the fraction of n
    sampled candidates (the design's own secrets for the same prefix) whose
    loss is at most the secret's: rank = 1 + #{candidates with loss <=
    secret's loss} among n + 1 (ties count against the secret). The estimate
    lies in [0, log2(n + 1)]: a secret the model prefers to every candidate
    gets the largest value n candidates can show, not its true exposure.
    """
    secret_loss = np.asarray(secret_loss, float)
    candidate_loss = np.asarray(candidate_loss, float)
    n = candidate_loss.shape[1]
    rank = 1 + (candidate_loss <= secret_loss[:, None]).sum(axis=1)
    return np.log2(n + 1) - np.log2(rank)


def extraction_summary(included: np.ndarray, secrets: np.ndarray, decoded: np.ndarray, exposures: np.ndarray,
                       candidates: int) -> dict:
    """Extraction-risk columns: exposure and greedy-decoding recovery, included canaries vs excluded ones.

    The excluded canaries were never trained on: their exposure (about
    1 / ln 2 = 1.44 bits on average when the model has no preference) and
    recovery rate are the chance level the included canaries' are read
    against.
    """
    included = np.asarray(included, bool)
    exact = (np.asarray(decoded) == np.asarray(secrets)).all(axis=1)
    tokens = (np.asarray(decoded) == np.asarray(secrets)).mean(axis=1)

    def mean(x, mask):
        return float(x[mask].mean()) if mask.any() else math.nan

    return {
        "exposure_candidates": int(candidates),
        "exposure_max": float(np.log2(candidates + 1)) if candidates else math.nan,
        "exposure_included_mean": mean(exposures, included) if candidates else math.nan,
        "exposure_excluded_mean": mean(exposures, ~included) if candidates else math.nan,
        "extraction_rate_included": mean(exact.astype(float), included),
        "extraction_rate_excluded": mean(exact.astype(float), ~included),
        "extraction_token_accuracy_included": mean(tokens, included),
    }


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


def claim_at_delta(ledger: Mapping, delta: float) -> float:
    """The audited run's epsilon at `delta`: the ledger's own at its delta, else its dp_event's at `delta`."""
    if math.isclose(float(delta), float(ledger["delta"]), rel_tol=1e-12):
        return claimed_epsilon(ledger)
    if not math.isfinite(claimed_epsilon(ledger)):
        return math.inf
    from ..privacy import accounting
    from ..privacy.mechanism import event_from_json

    if ledger.get("dp_event") is None:
        raise ValueError("the run ledger has no dp_event; rebuild the audited run")
    return float(accounting.epsilon(event_from_json(ledger["dp_event"], "ledger dp_event"), float(delta)))


def audit_cell(*, dataset: str, model: str, reference: str, local_reference: bool, ledger: Mapping, canaries: str,
               scores_out: str, result_out: str, confidence: float, guess_fractions: Sequence[float],
               batch_size: int, device: str = "auto", audit_delta: float | None = None) -> dict:
    """Score every canary with the audited model and the reference, write the scores and the cell's result.

    scores_out (Parquet): per canary `user_id`, `included`, `loss`,
    `reference_loss` (mean loss per secret token), `score_<name>` for each
    of SCORES, `exposure` (bits) and `extracted` (greedy decoding from the
    prefix gave the secret); result_out (JSON): the cell (method, target and
    claimed epsilon, delta, G, sigma, q, T, K), `audit_result` and
    `extraction_summary`. `audit_delta` (None: the run's delta) is the delta
    the bounds test; the claimed epsilon is then the run's at that delta.
    """
    import pandas as pd

    from ..data.canaries import read_canaries
    from ..io import write_json, write_parquet
    from ..training.models import load_model, resolve_device

    table = read_canaries(canaries)
    included = np.asarray(table["included"].to_pylist(), bool)
    prefixes = np.asarray(table["prefix"].to_pylist(), dtype=np.int64).reshape(table.num_rows, -1)
    secrets = np.asarray(table["secret"].to_pylist(), dtype=np.int64)
    candidates = np.asarray(table["candidates"].to_pylist(), dtype=np.int64).reshape(
        table.num_rows, -1, secrets.shape[1])
    bos = int(table["input_ids"][0].as_py()[0])
    length = secrets.shape[1]
    dev = resolve_device(device)
    losses = {}
    net = load_model(reference, dev, local=local_reference).eval()
    losses["reference_loss"] = secret_nll(net, prefixes, secrets, bos, batch_size, dev) / length
    del net
    net = load_model(model, dev, local=True).eval()
    secret_sum = secret_nll(net, prefixes, secrets, bos, batch_size, dev)
    losses["loss"] = secret_sum / length
    n_cand = candidates.shape[1]
    if n_cand:
        cand_sum = secret_nll(net, np.repeat(prefixes, n_cand, axis=0), candidates.reshape(-1, length), bos,
                              batch_size, dev).reshape(-1, n_cand)
        exposures = exposure(secret_sum, cand_sum)
    else:
        exposures = np.full(table.num_rows, math.nan)
    decoded = greedy_continuations(net, prefixes, length, bos, batch_size, dev)
    del net
    scores = membership_scores(losses["loss"], losses["reference_loss"])
    frame = pd.DataFrame({"user_id": table["user_id"].to_pylist(), "included": included,
                          "loss": losses["loss"], "reference_loss": losses["reference_loss"],
                          **{f"score_{k}": v for k, v in scores.items()}, "exposure": exposures,
                          "extracted": (decoded == secrets).all(axis=1)})
    run_delta = float(ledger["delta"])
    delta = run_delta if audit_delta is None else float(audit_delta)
    design = table["design"][0].as_py()
    result = {
        "dataset": dataset,
        "method": ledger["method"],
        "epsilon_target": float(ledger["epsilon_planned"]),
        "epsilon_claimed": claim_at_delta(ledger, delta),
        "epsilon_claimed_run": claimed_epsilon(ledger),
        "delta_run": run_delta,
        "canary_design": design,
        "prefix_length": int(prefixes.shape[1]),
        "secret_length": int(length),
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
        **extraction_summary(included, secrets, decoded, exposures, n_cand),
        "mean_loss_included": float(losses["loss"][included].mean()) if included.any() else math.nan,
        "mean_loss_excluded": float(losses["loss"][~included].mean()) if (~included).any() else math.nan,
    }
    result["bound_exceeds_claim"] = bound_exceeds_claim(result)
    result["fdp_bound_exceeds_claim"] = fdp_bound_exceeds_claim(result)
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
    # the f-DP estimator next to the (epsilon, delta) one; the canaries; the run's own claim; extraction risk
    "epsilon_lower_bound_fdp", "epsilon_lower_bound_fdp_ceiling", "loss_epsilon_lower_bound_fdp",
    "likelihood_ratio_epsilon_lower_bound_fdp", "canary_design", "prefix_length", "secret_length",
    "epsilon_claimed_run", "delta_run", "exposure_candidates", "exposure_max", "exposure_included_mean",
    "exposure_excluded_mean", "extraction_rate_included", "extraction_rate_excluded",
    "extraction_token_accuracy_included", "fdp_bound_exceeds_claim",
)


_FLOAT_COLUMNS = ("epsilon_target", "epsilon_claimed", "delta", "noise_multiplier", "sampling_rate",
                  "epsilon_lower_bound", "epsilon_lower_bound_ceiling", "confidence", "loss_auc",
                  "loss_tpr_at_1pct_fpr", "loss_epsilon_lower_bound",
                  "likelihood_ratio_auc", "likelihood_ratio_tpr_at_1pct_fpr", "likelihood_ratio_epsilon_lower_bound",
                  "epsilon_lower_bound_fdp", "epsilon_lower_bound_fdp_ceiling", "loss_epsilon_lower_bound_fdp",
                  "likelihood_ratio_epsilon_lower_bound_fdp", "epsilon_claimed_run", "delta_run", "exposure_max",
                  "exposure_included_mean", "exposure_excluded_mean", "extraction_rate_included",
                  "extraction_rate_excluded", "extraction_token_accuracy_included")


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
    for col in _FLOAT_COLUMNS:  # JSON writes inf as the string "inf"
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
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in cols)
    body = []
    for _, row in df.iterrows():
        cells = []
        for key, _ in cols:
            v = row[key]
            text = str(v).upper() if key == "method" else _fmt(v)
            cells.append(f"<td>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
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
        "lower bound above the claim would reveal a bug; a bound below it proves nothing (docs/privacy.md). "
        "Exposure (bits, Carlini et al. 2019) ranks each secret among sampled candidates; extracted: greedy "
        "decoding from the canary's prefix returns its secret.</p>\n" + ceiling +
        f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table>\n</body></html>\n"
    )
