"""The user-level membership audit of a trained model (docs/audits.md, "Auditing the released model").

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
from typing import Iterable, Mapping, Sequence

import numpy as np

from .audit_report import bound_exceeds_claim, fdp_bound_exceeds_claim
from .audit_stats import ESTIMATORS, SCORES, auc, correct_guesses, guess_sets, tpr_at_fpr


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
