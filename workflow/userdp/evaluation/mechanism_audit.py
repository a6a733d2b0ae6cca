"""White-box audit of the user-level mechanism: canary users with a known gradient direction, every update released.

Threat model (DP-SGD's own analysis): the adversary sees every privatised
update u_t = (sum of clipped unit gradients + noise) / divisor that the
engine releases, knows the model, the public constants (q, T, sigma, C, the
divisor) and every training user except which canaries were included. The
guarantee says that even this adversary learns at most (epsilon, delta) about
one user; this audit checks the implementation against that claim.

Canaries ("Dirac" canaries in the sense of Nasr et al. 2023, "Tight Auditing
of Differentially Private Machine Learning", made realisable through the
real clipping code): a tiny GPT-2 with untied embeddings in which only the
input embedding table `wte` is trainable. Canary user i owns G examples made
of one token v_i that no other user has, so its gradient lies entirely in row
v_i of `wte` and no other user's gradient touches that row. The learning rate
is 0, so every step evaluates the same parameters and canary i's clipped
gradient is the same known vector c_i (norm min(||g_i||, C); the canaries'
gradients are far above C, so each is clipped to exactly C) at every step: the
released row v_i of step t is (k_it c_i + noise) / divisor with k_it the
canary's units sampled in that step (ELS: k ~ Binomial(G, q); ULS: 0 or 1).
The optimizer and schedule run as configured (at rate 0): they post-process
the released update and are no part of the guarantee.

Each canary included with probability 1/2 (its coin); training runs through
the real engine (`training.engine.train`: its sampler, clipping, noise,
division, optimizer; one or several processes) with the noise multiplier the
project's calibration (`privacy.calibration.calibrate`) gives for the target
epsilon at the sampling that runs, and the claimed epsilon is the
accountant's epsilon of that run (`epsilon_achieved`). Every step's released
update is read through the engine's observation hook.

Scores (higher = more likely included), from the released updates only:

* `likelihood_ratio`: sum over steps of the log-likelihood ratio of the
  projection y_it = <u_t divisor, c_i / |c_i|> / C under "included"
  (mixture over k of N(k a_i, sigma^2), k's law the sampler's) against
  "excluded" (N(0, sigma^2)): the optimal test of one canary's membership;
* `count_aware`: the same per-step likelihood ratio when the divisor of each
  step, measured from rows no unit touches (pure noise of known std sigma C),
  is read as the number of sampled units: exact for a mechanism that divides
  by the realised batch size, uninformative (but harmless) for one that
  divides by the public expected size.

Adaptive clipping (`clipping: adaptive`, userdp.privacy.adaptive): the step's
clip norm C_t is released, so each projection is read in units of C_t with
amplitude min(||g_i||, C_t) / C_t and the gradient's own noise multiplier
sigma_g; the released count s_t is checked exactly (`count_checks`) against
the count the audit recomputes from every sampled unit's brute-force norm:
the residual must be the count's noise N(0, sigma_b^2), so a mechanism that
drops (or shrinks) the count's noise, or counts wrongly, fails the check.

The scores become an empirical user-level epsilon with the one-run bound of
Steinke, Nasr and Jagielski 2023 (`userdp.evaluation.audit`:
`epsilon_lower_bound`, `guess_sets`, `correct_guesses`) and, where each
canary's release is exactly Gaussian (q = 1: `gaussian_release`), also with
the f-DP one-run bound of Mahloujifar, Melis and Chaudhuri 2025 with the
Gaussian trade-off curve (`epsilon_lower_bound_fdp`, tighter: it catches half
the noise at 3,000 canaries and claimed epsilon 4, where the first needs tens
of thousands), every (score, guess set, estimator) tested at
(1 - confidence) / their number. `epsilon_lower_bound_ceiling` (and
`_fdp_ceiling`) is the largest bound this canary count, delta and level can
give (every guess of the best guess set right). An empirical bound above the claimed
epsilon means the implementation (or its accounting) does not meet its
claim; a bound below it is no proof of privacy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from scipy import special, stats

from ..errors import ConfigError
from ..privacy.adaptive import ADAPTIVE, AdaptiveClipping, of_config
from ..privacy.banded import marginal_std_factors, whiten
from .audit_stats import ESTIMATORS, correct_guesses, epsilon_lower_bound, guess_sets

log = logging.getLogger(__name__)

#: The scores of the white-box audit (see the module docstring).
SCORES = ("likelihood_ratio", "count_aware")
#: Columns of mechanism.csv (one row per audited cell).
COLUMNS = (
    "dataset", "method", "epsilon_target", "epsilon_claimed", "epsilon_lower_bound", "epsilon_lower_bound_ceiling",
    "bound_exceeds_claim", "epsilon_lower_bound_fdp", "epsilon_lower_bound_fdp_ceiling", "fdp_bound_exceeds_claim",
    "canaries", "canaries_included", "delta", "confidence", "noise_multiplier",
    "sampling_rate", "steps", "group_size", "clip_norm", "other_users", "processes", "best_score",
    "best_guesses", "best_correct", "noise_std_ratio", "divisor_ratio_min", "divisor_ratio_max",
    "noise_check_failed", "canaries_clipped", "epsilon_ledger", "seed",
)
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
#: Tokens of the other (non-canary) users' examples.
OTHER_TOKENS = 32
#: Tokens no user has: their rows of every released update are pure noise (the per-step divisor is measured there).
FREE_TOKENS = 64
CANARY_MODEL = {"architecture": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "tie_embeddings": False}


# ---------------------------------------------------------------- one audited cell


@dataclasses.dataclass(frozen=True)
class CellSetup:
    """One audited cell: the mechanism that runs and the audit's size."""

    method: str            # els | uls
    epsilon: float         # the target epsilon the noise is calibrated for
    canaries: int          # m canary users, each included with probability 1/2
    group_size: int        # G examples of every canary (and other) user; ELS accounts for G
    sampling_rate: float   # q of the sampler that runs (examples for ELS, users for ULS)
    steps: int             # T
    delta: float
    clip_norm: float
    other_users: int = 0   # non-canary users, each with G examples of their own tokens
    example_length: int = 4
    clipping: str = "flat"
    confidence: float = 0.95
    guess_fractions: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5)
    seed: int = 0
    processes: int = 1
    physical_batch_size: int = 64
    #: clipping "adaptive": privacy.adaptive's settings; None otherwise
    adaptive: AdaptiveClipping | None = None
    #: ULS as banded DP-FTRL (privacy.correlated_noise.bands; userdp.privacy.banded); 1: DP-SGD
    bands: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.adaptive, Mapping):  # a dict after a JSON round trip (several processes)
            object.__setattr__(self, "adaptive", AdaptiveClipping.from_record(self.adaptive))
        if (self.clipping == ADAPTIVE) != (self.adaptive is not None):
            raise ValueError(f"clipping {self.clipping!r} with adaptive {self.adaptive}: adaptive clipping's "
                             "settings are given exactly when clipping is 'adaptive'")
        if self.method not in ("els", "uls"):
            raise ValueError(f"method must be 'els' or 'uls', got {self.method!r}")
        if int(self.bands) < 1 or (self.bands > 1 and self.method != "uls"):
            raise ValueError(f"bands is {self.bands} for {self.method}: banded DP-FTRL (bands >= 2) is ULS only")
        if self.canaries < 2:
            raise ValueError(f"need at least 2 canaries, got {self.canaries}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.sampling_rate}")
        if self.method == "uls" and self.group_size > self.physical_batch_size:
            raise ValueError(f"ULS: G = {self.group_size} examples of one user must fit one micro-batch of "
                             f"{self.physical_batch_size}")

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_IDS) + OTHER_TOKENS + self.canaries + FREE_TOKENS

    def canary_token(self, i: np.ndarray | int) -> np.ndarray | int:
        return len(SPECIAL_IDS) + OTHER_TOKENS + i

    @property
    def free_tokens(self) -> np.ndarray:
        start = len(SPECIAL_IDS) + OTHER_TOKENS + self.canaries
        return np.arange(start, start + FREE_TOKENS)

    @property
    def coefficients(self) -> np.ndarray:
        """The strategy's band coefficients the accounting assumes ([1.0]: DP-SGD's independent noise)."""
        from ..privacy.banded import bsr_coefficients

        return bsr_coefficients(self.bands)

    def unit_law(self) -> tuple[np.ndarray, np.ndarray]:
        """(k, P(k)): how many of an included canary's units a step samples (ELS: Binomial(G, q); ULS: Bernoulli(q))."""
        from ..privacy.accounting import binomial_sensitivities

        g = self.group_size if self.method == "els" else 1
        k, p = binomial_sensitivities(g, self.sampling_rate)
        return np.asarray(k, float), np.asarray(p, float)


def accounted_mechanism(method: str, sampling_rate: float, steps: int, group_size: int, bands: int = 1):
    """The mechanism the accountant is given for a cell (`privacy.mechanism`; the mutation tests replace it)."""
    from ..privacy import mechanism

    if bands > 1:
        return mechanism.BandedULS(float(sampling_rate), int(steps), int(group_size), bands=int(bands))
    return mechanism.get(method)(float(sampling_rate), int(steps), int(group_size))


def calibrate_cell(setup: CellSetup) -> dict[str, float]:
    """The noise multiplier of the project's calibration for the target epsilon at the sampling that runs.

    Returns sigma and the claimed epsilon: the accountant's epsilon at sigma
    (`epsilon_achieved`, at the fine discretization), never the target.
    """
    from ..privacy.calibration import calibrate

    mech = accounted_mechanism(setup.method, setup.sampling_rate, setup.steps, setup.group_size, setup.bands)
    result = calibrate(mech, setup.epsilon, setup.delta, cell=f"mechanism audit {setup.method} eps {setup.epsilon:g}")
    return {"noise_multiplier": float(result.noise_multiplier), "epsilon_claimed": float(result.epsilon_achieved)}


# ---------------------------------------------------------------- scores


def _log_terms(y: np.ndarray, amp: np.ndarray, k: np.ndarray, pk: np.ndarray, sigma: float) -> np.ndarray:
    """[m, T, K]: log P(k) + (k a y - (k a)^2 / 2) / sigma^2 for y [m, T] and amplitude a [m] or [m, T]."""
    amp = np.asarray(amp, float)  # [m]: one per canary; [m, T]: per canary and step (adaptive clipping)
    ka = (amp[:, None, None] if amp.ndim == 1 else amp[:, :, None]) * k[None, None, :]  # [m, 1 or T, K]
    return (ka * y[:, :, None] - 0.5 * ka ** 2) / sigma ** 2 + np.log(np.maximum(pk, 1e-300))[None, None, :]


def _log_mix(y: np.ndarray, amp: np.ndarray, k: np.ndarray, pk: np.ndarray, sigma: float) -> np.ndarray:
    """log sum_k P(k) exp((k a y - (k a)^2 / 2) / sigma^2): the log-likelihood ratio of each y [m, T]."""
    return special.logsumexp(_log_terms(y, amp, k, pk, sigma), axis=2)


def likelihood_ratio_scores(y: np.ndarray, amp: np.ndarray, k: np.ndarray, pk: np.ndarray, sigma: float) -> np.ndarray:
    """Per canary: sum over steps of log P(y_t | included) / P(y_t | excluded); y [m, T] in units of C."""
    return _log_mix(np.asarray(y, float), np.asarray(amp, float), k, pk, sigma).sum(axis=1)


def count_aware_scores(y: np.ndarray, counts: np.ndarray, amp: np.ndarray, k: np.ndarray, pk: np.ndarray,
                       sigma: float, other_law: np.ndarray, max_count: int = 64) -> np.ndarray:
    """Per canary: sum over steps of the log-likelihood ratio of (y_t, n_t) when n_t is the step's unit count.

    y [m, T]: projections in units of C (already multiplied by the step's
    measured divisor); counts [T]: the divisor read as a count (None entries
    or counts above max_count: the step adds only its likelihood-ratio term).
    Every canary's units in a step follow the generating polynomial
    w_j(z) = 1/2 + 1/2 sum_k P(k) L_j(k) z^k (coin unknown), L_j(k) the
    Gaussian likelihood ratio of its projection; the other users' units
    `other_law` (P(count) of the non-canary units). The ratio for canary i
    is [sum_k P(k) L_i(k) E_{n-k}] / E_n with E the coefficients of the
    product of everyone else's polynomials (prefix and suffix products, in
    log space), truncated at max_count units.
    """
    y = np.asarray(y, float)
    m, T = y.shape
    K = max_count + 1
    n = np.asarray([-1 if c is None else int(c) for c in counts])
    usable = (n >= 0) & (n < K)
    if not usable.any():  # no step's divisor reads as a small count: the likelihood-ratio score alone
        return likelihood_ratio_scores(y, amp, k, pk, sigma)
    lk = np.full((m, T, K), -np.inf)
    kk = k.astype(int)
    lterms = _log_terms(y, amp, k, pk, sigma)
    for j, kv in enumerate(kk):  # included: P(k) L(k) at degree k
        if kv < K:
            lk[:, :, kv] = np.logaddexp(lk[:, :, kv], lterms[:, :, j])
    # coin 1/2: w_j = 1/2 [k=0] + 1/2 included-polynomial
    poly = lk + math.log(0.5)
    poly[:, :, 0] = np.logaddexp(poly[:, :, 0], math.log(0.5))

    def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # log-space polynomial product, truncated to K: [T, K]
        out = np.full(a.shape, -np.inf)
        for d in range(K):
            out[:, d] = special.logsumexp(a[:, : d + 1] + b[:, d::-1], axis=1)
        return out

    other = np.full((T, K), -np.inf)
    law = np.log(np.maximum(np.asarray(other_law, float)[:K], 1e-300))
    other[:, : law.size] = law[None, :]
    prefix = np.empty((m + 1, T, K))
    prefix[0] = other
    for j in range(m):
        prefix[j + 1] = mul(prefix[j], poly[j])
    suffix = np.full((T, K), -np.inf)
    suffix[:, 0] = 0.0
    scores = np.zeros(m)
    tt = np.arange(T)
    lr_only = _log_mix(y, np.asarray(amp, float), k, pk, sigma)  # steps whose count is not usable
    for i in range(m - 1, -1, -1):
        rest = mul(prefix[i], suffix)  # everyone but canary i: [T, K]
        num = np.full(T, -np.inf)
        for j, kv in enumerate(kk):
            idx = n - kv
            ok = usable & (idx >= 0)
            val = np.full(T, -np.inf)
            val[ok] = lterms[i, ok, j] + rest[tt[ok], idx[ok]]
            num = np.logaddexp(num, val)
        den = np.where(usable, rest[tt, np.clip(n, 0, K - 1)], 0.0)
        per_step = np.where(usable, num - den, lr_only[i])
        per_step = np.where(np.isfinite(per_step), per_step, np.sign(per_step) * 1e6)
        scores[i] = per_step.sum()
        suffix = mul(suffix, poly[i])
    return scores


# ---------------------------------------------------------------- the one-run bound


def _estimators(gaussian: bool) -> dict[str, Callable[..., float]]:
    """The one-run estimators an audit applies: the (epsilon, delta) bound always, the f-DP (Gaussian) bound
    where each canary's release is exactly a Gaussian mechanism (`gaussian_release`)."""
    return dict(ESTIMATORS) if gaussian else {"": epsilon_lower_bound}


def gaussian_release(sampling_rate: float) -> bool:
    """Whether each canary's released rows are exactly a composition of Gaussian mechanisms: at q = 1 every
    included canary contributes its clipped gradient in every step (k = G for ELS, 1 for ULS), so the honest
    mechanism is mu-GDP per canary and the f-DP bound of Mahloujifar et al. 2025 applies to it; with
    subsampling its trade-off curve is not Gaussian and only the (epsilon, delta) bound is reported."""
    return float(sampling_rate) == 1.0


def _shapes_and_level(m: int, n_scores: int, n_estimators: int, confidence: float,
                      guess_fractions: Iterable[float]) -> tuple[list[tuple[int, int]], float]:
    shapes = sorted({(g.n_in, g.n_out) for g in guess_sets(m, list(guess_fractions))})
    return shapes, (1.0 - confidence) / (len(shapes) * n_scores * n_estimators)


def audit_bound(scores: Mapping[str, np.ndarray], included: np.ndarray, *, delta: float, confidence: float,
                guess_fractions: Iterable[float], gaussian: bool = False) -> dict[str, Any]:
    """The empirical epsilon lower bounds and their ceilings over every (score, guess set, estimator),
    Bonferroni at `confidence` over all of them.

    Guess counts and sides are those of the membership audit (`audit.guess_sets`), crossed with this audit's
    scores. `epsilon_lower_bound` is `audit.epsilon_lower_bound` (Steinke, Nasr and Jagielski 2023; no
    assumption on the mechanism); with `gaussian` (each canary's release exactly Gaussian, `gaussian_release`)
    also `epsilon_lower_bound_fdp`, `audit.epsilon_lower_bound_fdp` (the f-DP one-run bound of Mahloujifar,
    Melis and Chaudhuri 2025 with the Gaussian trade-off curve, tighter), else NaN.
    """
    included = np.asarray(included, bool)
    m = int(included.size)
    estimators = _estimators(gaussian)
    shapes, level = _shapes_and_level(m, len(scores), len(estimators), confidence, guess_fractions)
    sets = [(name, n_in, n_out) for name in scores for n_in, n_out in shapes]
    out: dict[str, Any] = {"epsilon_lower_bound_fdp": math.nan,
                           **ceilings(m, delta, confidence, guess_fractions, len(scores), gaussian)}
    for suffix, bound_of in estimators.items():
        best = {"eps": 0.0, "score": None, "guesses": 0, "correct": 0}
        for name, n_in, n_out in sets:
            v = correct_guesses(scores[name], included, n_in, n_out)
            eps = bound_of(m, n_in + n_out, v, delta, level)
            if eps > best["eps"] or best["score"] is None:
                best = {"eps": eps, "score": name, "guesses": n_in + n_out, "correct": v}
        out[f"epsilon_lower_bound{suffix}"] = best["eps"]
        if not suffix:
            out.update({"best_score": best["score"], "best_guesses": best["guesses"],
                        "best_correct": best["correct"]})
    return {**out, "guess_sets": len(sets) * len(estimators), "level_per_guess_set": level, "canaries": m,
            "canaries_included": int(included.sum())}


def ceilings(canaries: int, delta: float, confidence: float, guess_fractions: Iterable[float],
             n_scores: int = len(SCORES), gaussian: bool = False) -> dict[str, float]:
    """The largest bound each estimator of an audit of this size can give (all guesses right), before anything
    trains: the `epsilon_lower_bound_ceiling` and `epsilon_lower_bound_fdp_ceiling` (NaN without `gaussian`)
    that `audit_bound` reports."""
    estimators = _estimators(gaussian)
    shapes, level = _shapes_and_level(canaries, n_scores, len(estimators), confidence, guess_fractions)
    out = {"epsilon_lower_bound_fdp_ceiling": math.nan}
    for suffix, bound_of in estimators.items():
        out[f"epsilon_lower_bound{suffix}_ceiling"] = max(bound_of(canaries, a + b, a + b, delta, level)
                                                          for a, b in shapes)
    return out


def bound_ceiling(canaries: int, delta: float, confidence: float, guess_fractions: Iterable[float],
                  n_scores: int = len(SCORES), gaussian: bool = False) -> float:
    """The largest bound an audit of this size can give (all guesses right, the best estimator)."""
    return float(np.nanmax(list(ceilings(canaries, delta, confidence, guess_fractions, n_scores,
                                         gaussian).values())))


# ---------------------------------------------------------------- a simulated mechanism (tests, power table)


def simulate_scores(setup: CellSetup, sigma: float, rng: np.random.Generator, *, noise_scale: float = 1.0
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Scores of a numpy simulation of the released canary rows: each step's projection is k a + N(0, sigma^2).

    The Gaussian mechanism the accountant analyses, without the engine (the
    estimator's check: its bound must never exceed the true epsilon).
    noise_scale multiplies the noise actually drawn (1: the honest mechanism).
    """
    m, T = setup.canaries, setup.steps
    included = rng.random(m) < 0.5
    k, pk = setup.unit_law()
    draws = rng.choice(k, size=(m, T), p=pk / pk.sum()) * included[:, None]
    y = draws + rng.normal(0.0, sigma * noise_scale, size=(m, T))
    lr = likelihood_ratio_scores(y, np.ones(m), k, pk, sigma)
    # no divisor reads as a count here, so the count-aware score is the likelihood ratio (as in a run that
    # divides by the public q N); both are kept so that the bound tests the same guess sets as an engine run
    return {"likelihood_ratio": lr, "count_aware": lr.copy()}, included


# ---------------------------------------------------------------- the engine run


def _coins(setup: CellSetup) -> np.ndarray:
    """Each canary's coin (included with probability 1/2), from the audit seed."""
    from ..seeding import derive_seed

    rng = np.random.default_rng(derive_seed(int(setup.seed), "mechanism-audit", setup.method, "coins"))
    return rng.random(setup.canaries) < 0.5


def training_table(setup: CellSetup, included: np.ndarray):
    """The audit's train table: the included canaries (G copies of [v_i] * L each) and the other users."""
    import pyarrow as pa

    from ..seeding import derive_seed

    rng = np.random.default_rng(derive_seed(int(setup.seed), "mechanism-audit", "others"))
    users, rows = [], []
    for i in np.flatnonzero(included):
        for _ in range(setup.group_size):
            users.append(f"canary{i:06d}")
            rows.append([int(setup.canary_token(int(i)))] * setup.example_length)
    lo = len(SPECIAL_IDS)
    for j in range(setup.other_users):
        for _ in range(setup.group_size):
            users.append(f"other{j:06d}")
            rows.append(rng.integers(lo, lo + OTHER_TOKENS, size=setup.example_length).tolist())
    return pa.table({"user_id": pa.array(users, pa.string()),
                     "example_id": pa.array(np.arange(len(users)), pa.int64()),
                     "input_ids": pa.array(rows, pa.list_(pa.int32()))})


def canary_model(setup: CellSetup):
    """The tiny GPT-2 (untied embeddings) with only the input embedding table trainable."""
    from ..training.models import build_model

    model = build_model(CANARY_MODEL, setup.vocab_size, setup.example_length, SPECIAL_IDS, seed=int(setup.seed))
    for name, p in model.named_parameters():
        p.requires_grad_(name == "transformer.wte.weight")
    return model


def canary_gradients(model, setup: CellSetup) -> np.ndarray:
    """[m, d]: every canary's (unclipped) unit gradient, row v_i of the input embedding's gradient.

    One backward of the sum of the canaries' row losses (`training.clipping.row_losses`, the loss the
    engine clips): row v_i of the embedding gradient is canary i's alone.
    """
    import torch

    from ..training.clipping import row_losses

    wte = model.transformer.wte.weight
    ids = torch.as_tensor(np.repeat(setup.canary_token(np.arange(setup.canaries))[:, None],
                                    setup.example_length, axis=1), dtype=torch.long)
    mask = torch.ones_like(ids)
    losses, _ = row_losses(model(input_ids=ids, attention_mask=mask).logits, ids, mask)
    (grad,) = torch.autograd.grad(losses.sum(), [wte])
    return grad[setup.canary_token(np.arange(setup.canaries))].detach().numpy().copy()


def run_spec(setup: CellSetup, n_units: int, calibrated: Mapping[str, float]):
    """The RunSpec the engine executes: the sampling that runs and the calibrated noise."""
    from ..privacy.spec import RunSpec

    q = float(setup.sampling_rate)
    return RunSpec(dataset="mechanism-audit", method=setup.method, epsilon=float(setup.epsilon), delta=setup.delta,
                   group_size=setup.group_size, group_size_rule="explicit", sampling_rate=q, steps=setup.steps,
                   expected_batch=q * n_units / setup.bands, noise_multiplier=float(calibrated["noise_multiplier"]),
                   epsilon_achieved=float(calibrated["epsilon_claimed"]), clip_norm=float(setup.clip_norm),
                   clipping=setup.clipping, accountant=accounted_mechanism(setup.method, q, setup.steps,
                                                                           setup.group_size, setup.bands).accountant,
                   adaptive_clipping=None if setup.adaptive is None else setup.adaptive.record(),
                   correlated_noise=None if setup.bands == 1 else {"bands": int(setup.bands)})


def unit_norms(model, pool, setup: CellSetup, canary_grads: np.ndarray) -> np.ndarray:
    """Every unit's gradient norm (ELS: per pool row; ULS: per pool user), for the adaptive count's check.

    Canary units: their known gradient (`canary_gradients`; a ULS canary's G equal rows average to one row's).
    Other units: brute force, one backward per row of `training.clipping.row_losses` (the loss the engine
    clips), a ULS user's rows averaged as the engine weights them (1 / m_u). The learning rate is 0, so each
    unit's norm is the same at every step.
    """
    import torch

    from ..training.clipping import row_losses

    wte = model.transformer.wte.weight
    canary = np.linalg.norm(np.asarray(canary_grads, float), axis=1)

    def row_grad(r: int) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(pool.tokens(r), dtype=np.int64))[None]
        mask = torch.ones_like(ids)
        losses, _ = row_losses(model(input_ids=ids, attention_mask=mask).logits, ids, mask)
        return torch.autograd.grad(losses.sum(), [wte])[0].double()

    def canary_of(u: int) -> int | None:
        name = pool.user_ids[u]
        return int(name[len("canary"):]) if name.startswith("canary") else None

    units = ([(int(pool.example_user[r]), [r]) for r in range(pool.n_examples)] if setup.method == "els" else
             [(u, range(int(pool.user_offsets[u]), int(pool.user_offsets[u + 1]))) for u in range(pool.n_users)])
    return np.array([canary[c] if (c := canary_of(u)) is not None
                     else float(torch.linalg.vector_norm(sum(row_grad(r) for r in rows) / len(rows)))
                     for u, rows in units])


def train_cell(setup: CellSetup, calibrated: Mapping[str, float], *, settings: Mapping[str, Any] | None = None,
               dist=None) -> dict[str, Any] | None:
    """Train the audit's canaries through the real engine (PrivateTraining, make_private's core); every step's
    released canary and free rows.

    settings: training settings of the config (optimizer, schedule, physical batch size, device); the
    learning rate is always 0 (module docstring). Returns None on ranks other than 0 of a process group.
    """
    import torch

    from ..layout import fmt_num
    from ..training import optim, run_seeds
    from ..training.pool import build_pool
    from ..training.private import PrivateTraining
    from ..training.settings import TrainSettings

    included = _coins(setup)
    pool = build_pool(training_table(setup, included), setup.group_size, seed=int(setup.seed))
    n_units = pool.n_examples if setup.method == "els" else pool.n_users
    spec = run_spec(setup, n_units, calibrated)
    model = canary_model(setup)
    grads = canary_gradients(model, setup)
    s = dict(settings or {})
    train_settings = TrainSettings(
        learning_rate=0.0, optimizer=s.get("optimizer", "sgd"), schedule=s.get("schedule", "constant"),
        warmup_steps=0, physical_batch_size=int(s.get("physical_batch_size", setup.physical_batch_size)),
        sequence_length=setup.example_length, checkpoint_every=10 ** 9, device="cpu", log_every_s=1e9)
    wte = model.transformer.wte.weight
    canary_rows = torch.as_tensor(setup.canary_token(np.arange(setup.canaries)), dtype=torch.long)
    free_rows = torch.as_tensor(setup.free_tokens, dtype=torch.long)
    released: list[np.ndarray] = []
    free: list[np.ndarray] = []
    # adaptive clipping: per step (C_t, released count s_t, the count the audit recomputes from the unit norms)
    counts: list[tuple[float, float, float]] = []
    main = dist is None or not dist.active or dist.is_main  # only rank 0's records are returned
    norms = unit_norms(model, pool, setup, grads) if setup.adaptive is not None and main else None

    def observe(o) -> None:  # the privatised update the step released, as the engine left it in p.grad
        released.append(wte.grad[canary_rows].detach().numpy().copy())
        free.append(wte.grad[free_rows].detach().numpy().copy())
        if norms is not None:
            rows = np.asarray(o.selection.rows)
            units = rows if setup.method == "els" else np.unique(pool.example_user[rows])
            n = norms[units]
            counts.append((float(o.clip_norm), float(o.released_count),
                           float(np.sum(n <= o.clip_norm) - 0.5 * n.size)))

    seeds = run_seeds.run_seeds(int(setup.seed), 0, "mechanism-audit", setup.method, fmt_num(float(setup.epsilon)), 0,
                             setup.group_size)
    # The audit drives the core userdp.make_private returns (PrivateTraining: engine.setup + the engine's step),
    # with the config's optimizer and schedule at learning rate 0; nothing is written.
    optimizer = optim.make_optimizer([wte], train_settings.optimizer, 0.0)
    scheduler = optim.make_scheduler(optimizer, train_settings.schedule, 0, setup.steps)
    dp = PrivateTraining(model, optimizer, pool, spec, train_settings, seeds, 0, scheduler=scheduler,
                         observe=observe, dist=dist)
    while dp.steps_done < spec.steps:
        dp.step()
    if dist is not None and dist.active and not dist.is_main:
        return None
    ledger = dp.ledger()
    divisor = float(spec.expected_batch)  # q N (p N / b): the public divisor the run was given
    adaptive = None
    if counts:
        c = np.asarray(counts, float)
        adaptive = {"clip_norms": c[:, 0], "released_counts": c[:, 1], "recomputed_counts": c[:, 2],
                    # what the accounting says they must be (privacy.adaptive), not what the engine used
                    "gradient_noise_multiplier": setup.adaptive.gradient_noise_multiplier(spec.noise_multiplier,
                                                                                          divisor),
                    "count_noise_std": setup.adaptive.count_std(divisor)}
    return {"included": included, "released": np.stack(released, 1), "free": np.stack(free, 1),
            "gradients": grads, "divisor": divisor, "n_units": n_units, "ledger": ledger, "adaptive": adaptive,
            "partitions": canary_partitions(setup, int(seeds["sampler"])),
            "other_units": n_units - (int(included.sum()) * (setup.group_size if setup.method == "els" else 1))}


def canary_partitions(setup: CellSetup, sampler_seed: int) -> np.ndarray:
    """[m]: each canary's cyclic partition (banded DP-FTRL), recomputed from its id and the sampler's seed, as the
    adversary of the threat model can (zeros for DP-SGD: every step is every canary's)."""
    if setup.bands == 1:
        return np.zeros(setup.canaries, np.int64)
    from ..training.sampling import CyclicPoissonSampler

    ids = [f"canary{i:06d}" for i in range(setup.canaries)]
    return CyclicPoissonSampler(ids, float(setup.sampling_rate), sampler_seed, setup.bands).partitions


def noise_checks(setup: CellSetup, sigma: float, run: Mapping[str, Any]) -> dict[str, Any]:
    """Direct checks of the released noise in the rows no unit touches (pure noise / divisor).

    noise_std_ratio: the noise's measured standard deviation there, times the public divisor q N, over
    sigma C (1 for the mechanism as accounted; 0.5 with half the noise). divisor_ratio_min/max: each step's
    divisor measured there (sigma C sqrt(d) / ||rows||) over q N (1 at every step when the division is by
    the public expected size). noise_check_failed: a ratio further from 1 than 5 standard errors of the
    measurement (relative error about 1 / sqrt(2 d T), resp. 1 / sqrt(2 d) per step). Not an epsilon bound:
    an exact test of two things the accountant assumes.
    """
    free = np.asarray(run["free"], float)  # [F, T, d]
    d_free = free.shape[0] * free.shape[2]
    T = free.shape[1]
    sigma, C = gradient_noise(setup, sigma, run)
    divisor = float(run["divisor"])
    expected = sigma * C / divisor  # [T]
    if setup.bands > 1:  # banded DP-FTRL: step t's noise has std sigma C ||row t of C^-1|| / divisor
        expected = expected * marginal_std_factors(setup.coefficients, T)
    per_step = np.sqrt((free ** 2).sum(axis=(0, 2)) / d_free)  # measured std per step
    ratio = float(np.sqrt(np.mean(per_step ** 2)) / expected[0]) if run.get("adaptive") is None \
        and setup.bands == 1 else float(np.sqrt(np.mean((per_step / expected) ** 2)))  # fixed C: the same float
    div = expected / np.maximum(per_step, 1e-300)  # measured divisor / q N
    tol_all, tol_step = 5 / math.sqrt(2 * d_free * T), 5 / math.sqrt(2 * d_free)
    failed = abs(ratio - 1) > tol_all or bool(np.any(np.abs(div - 1) > tol_step))
    out = {"noise_std_ratio": ratio, "divisor_ratio_min": float(div.min()), "divisor_ratio_max": float(div.max()),
           "noise_check_failed": bool(failed)}
    if setup.bands > 1:
        out.update(correlation_checks(setup, free * (divisor / (sigma * C))[None, :, None]))
        out["noise_std_ratio"] = out.pop("whitened_std_ratio")
        out["noise_check_failed"] = bool(out["noise_check_failed"] or out["correlation_check_failed"]
                                         or abs(out["noise_std_ratio"] - 1) > tol_all)
    if run.get("adaptive") is not None:
        out.update(count_checks(run["adaptive"]))
        out["noise_check_failed"] = bool(out["noise_check_failed"] or out["count_check_failed"])
    return out


def correlation_checks(setup: CellSetup, noise: np.ndarray) -> dict[str, Any]:
    """Banded DP-FTRL: the free rows' noise in units of sigma C ([F, T, d], std C^-1 z), whitened by the accounted
    strategy C, must be z: i.i.d. N(0, 1) over steps.

    whitened_std_ratio: the whitened noise's root mean square (1 as accounted; 1 / zeta when the engine's bands
    have column norm zeta, a sensitivity the accountant did not assume). noise_correlation: the largest |lag-k
    autocorrelation| of the whitened noise, k = 1..b-1, in units of its standard error 1 / sqrt(d (T - k)): about
    N(0, 1) each; far above 5 when the engine's noise is not C^-1 z (independent noise whitens to C z, whose lag-1
    correlation is sum_k c_k c_{k+1}). correlation_check_failed: that largest value above 5. An exact test, like
    the gradient's noise check.
    """
    white = whiten(noise, setup.coefficients, axis=1)
    T, d = white.shape[1], white.shape[0] * white.shape[2]
    worst = 0.0
    for k in range(1, min(setup.bands, T)):
        rho = float(np.mean(white[:, k:, :] * white[:, :-k, :]))
        worst = max(worst, abs(rho) * math.sqrt(d * (T - k)))
    return {"whitened_std_ratio": float(np.sqrt(np.mean(white ** 2))), "noise_correlation": worst,
            "correlation_check_failed": bool(worst > 5)}


def banded_blocks(y: np.ndarray, amp: np.ndarray, partitions: np.ndarray, coefficients: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Banded DP-FTRL: each canary's releases as one value per participation ([m, ceil(T / b)] each).

    y [m, T]: the canary's projections in units of C (noise sigma w_t, signal k_t a_t); amp [m, T]. Whitened by C,
    a participation at step s (s = its partition + j b) reaches rows s .. s + b - 1 with the coefficients c and no
    other participation of the canary reaches them (they are b apart): its projection on c / ||c|| (c cut at T) is
    k_s a_s ||c|| + N(0, sigma^2), the per-step Gaussian of DP-SGD's score with amplitude a_s ||c||.
    """
    c = np.asarray(coefficients, float)
    b, (m, T) = c.size, y.shape
    white = whiten(y, c, axis=1)
    rounds = -(-T // b)
    Y, A = np.zeros((m, rounds)), np.zeros((m, rounds))  # a round past T: amplitude 0, adds nothing to a score
    for part in range(b):
        rows = np.flatnonzero(np.asarray(partitions) == part)
        for j, s in enumerate(range(part, T, b)):
            cut = c[: min(b, T - s)]
            norm = float(np.linalg.norm(cut))
            Y[rows, j] = white[rows, s:s + cut.size] @ cut / norm
            A[rows, j] = amp[rows, s] * norm
    return Y, A


def gradient_noise(setup: CellSetup, sigma: float, run: Mapping[str, Any]) -> tuple[float, np.ndarray]:
    """(the gradient's noise multiplier, each step's clip norm [T]): (sigma, C) with a fixed clip norm; with
    adaptive clipping sigma_g and the released C_t."""
    T = np.asarray(run["released"]).shape[1]
    a = run.get("adaptive")
    if a is None:
        return float(sigma), np.full(T, float(setup.clip_norm))
    return float(a["gradient_noise_multiplier"]), np.asarray(a["clip_norms"], float)


def count_checks(adaptive: Mapping[str, Any]) -> dict[str, Any]:
    """Adaptive clipping: the released counts minus the counts the audit recomputes are the count's noise?

    count_noise_ratio: their root mean square over sigma_b (1 as accounted; 0 when the noise is dropped).
    count_check_failed: the ratio further from 1 than 5 standard errors (1 / sqrt(2 T)), or their mean further
    from 0 than 5 sigma_b / sqrt(T) (a count that is off). An exact test, like the gradient's noise check.
    """
    resid = np.asarray(adaptive["released_counts"], float) - np.asarray(adaptive["recomputed_counts"], float)
    std, T = float(adaptive["count_noise_std"]), resid.size
    ratio = float(np.sqrt(np.mean(resid ** 2)) / std)
    failed = abs(ratio - 1) > 5 / math.sqrt(2 * T) or abs(float(resid.mean())) > 5 * std / math.sqrt(T)
    return {"count_noise_ratio": ratio, "count_check_failed": bool(failed)}


def score_run(setup: CellSetup, sigma: float, run: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The scores of SCORES from a run's released rows (`train_cell`); with adaptive clipping each step is read
    at its released C_t, with the gradient's noise multiplier sigma_g."""
    sigma, C = gradient_noise(setup, sigma, run)  # C: [T]
    g = np.asarray(run["gradients"], float)
    norms = np.linalg.norm(g, axis=1)
    direction = g / np.maximum(norms, 1e-300)[:, None]
    amp = (np.ones_like(norms) if setup.clipping == "normalized" else np.minimum(norms, C[0]) / C[0]) \
        if setup.adaptive is None else np.minimum(norms[:, None], C[None, :]) / C[None, :]
    rel = np.asarray(run["released"], float)  # [m, T, d]
    proj = np.einsum("mtd,md->mt", rel, direction) / C[None, :]
    k, pk = setup.unit_law()
    y_public = proj * float(run["divisor"])
    if setup.bands > 1:  # one Gaussian per participation (the divisor is public: no count-aware score)
        amp_t = np.broadcast_to(np.asarray(amp, float).reshape(len(norms), -1), proj.shape)
        y_rounds, amp_rounds = banded_blocks(y_public, amp_t, run["partitions"], setup.coefficients)
        return {"likelihood_ratio": likelihood_ratio_scores(y_rounds, amp_rounds, k, pk, sigma)}
    scores = {"likelihood_ratio": likelihood_ratio_scores(y_public, amp, k, pk, sigma)}
    # The step's divisor, measured in the rows no unit touches (pure noise of std sigma C before the division)
    free = np.asarray(run["free"], float)  # [F, T, d]
    d_free = free.shape[0] * free.shape[2]
    fnorm = np.sqrt((free ** 2).sum(axis=(0, 2)))
    measured = sigma * C * math.sqrt(d_free) / np.maximum(fnorm, 1e-300)  # [T]
    counts = [int(round(x)) if abs(x - round(x)) < 0.3 else None for x in measured]
    cap = max([c for c in counts if c is not None] + [0]) + 1
    other = stats.binom.pmf(np.arange(cap + 1), int(run["other_units"]), float(setup.sampling_rate))
    scores["count_aware"] = count_aware_scores(proj * measured[None, :], counts, amp, k, pk, sigma, other,
                                               max_count=min(cap, 64))
    return scores


def audit_cell(setup: CellSetup, *, settings: Mapping[str, Any] | None = None, dist=None,
               dataset: str = "") -> dict[str, Any] | None:
    """Calibrate, train and score one cell; its row of mechanism.csv (None on ranks other than 0)."""
    calibrated = calibrate_cell(setup)
    run = train_cell(setup, calibrated, settings=settings, dist=dist)
    if run is None:
        return None
    sigma = calibrated["noise_multiplier"]
    bound = audit_bound(score_run(setup, sigma, run), run["included"], delta=setup.delta,
                        confidence=setup.confidence, guess_fractions=setup.guess_fractions,
                        gaussian=gaussian_release(setup.sampling_rate))
    row = {
        "dataset": dataset, "method": setup.method, "epsilon_target": float(setup.epsilon),
        "epsilon_claimed": calibrated["epsilon_claimed"], **bound,
        "delta": setup.delta, "confidence": setup.confidence, "noise_multiplier": sigma,
        "sampling_rate": setup.sampling_rate, "steps": setup.steps, "group_size": setup.group_size,
        "clip_norm": setup.clip_norm, "other_users": setup.other_users, "processes": setup.processes,
        "seed": setup.seed,
        "epsilon_ledger": float(run["ledger"]["epsilon"]) if run.get("ledger") else math.nan,
        "canaries_clipped": float(np.mean(np.linalg.norm(run["gradients"], axis=1)[:, None]
                                          > gradient_noise(setup, sigma, run)[1][None, :])),
        **noise_checks(setup, sigma, run),
    }
    if setup.bands > 1:
        row["bands"] = int(setup.bands)
    row["fdp_bound_exceeds_claim"] = bool(row["epsilon_lower_bound_fdp"] > row["epsilon_claimed"])  # NaN: False
    row["bound_exceeds_claim"] = bool(row["epsilon_lower_bound"] > row["epsilon_claimed"]
                                      or row["fdp_bound_exceeds_claim"])
    return row


# ---------------------------------------------------------------- the config, the table, several processes


def mechanism_params(config: Mapping) -> dict[str, Any]:
    """Everything the audit of one dataset reads from the config (rule params; the CLI uses the same)."""
    from ..grid import audit_epsilons
    from ..io import sorted_dict

    a = config["audit"]
    mech = dict(a["mechanism"])
    t = config["training"]
    return sorted_dict({
        "methods": list(a["methods"]), "epsilons": audit_epsilons(config), "seed": int(a["seed"]),
        "confidence": float(a["confidence"]), "guess_fractions": [float(f) for f in a["guess_fractions"]],
        "clipping": config["privacy"]["clipping"], "optimizer": t["optimizer"], "schedule": t["schedule"],
        **({"adaptive": adaptive.record()} if (adaptive := of_config(config["privacy"])) is not None else {}),
        **({"bands": int(cn["bands"])} if (cn := config["privacy"].get("correlated_noise")) else {}),
        **{k: mech[k] for k in ("canaries", "group_size", "sampling_rate", "steps", "delta", "clip_norm",
                                "other_users", "processes", "physical_batch_size", "example_length")},
    })


def select_cells(params: Mapping[str, Any], method: str | None = None, epsilon: float | None = None
                 ) -> list[CellSetup]:
    """The audited cells (audit.methods x audit.epsilons), or the one named; ConfigError for one not audited."""
    methods, epsilons = list(params["methods"]), [float(e) for e in params["epsilons"]]
    if method is not None and method not in methods:
        raise ConfigError(f"method {method!r} is not audited: audit.methods is {methods}. Give one of them, or "
                          "add it to audit.methods.")
    if epsilon is not None and not any(math.isclose(float(epsilon), e, rel_tol=1e-9) for e in epsilons):
        raise ConfigError(f"epsilon {epsilon:g} is not audited: the audit's epsilons (audit.epsilons, or "
                          f"grid.epsilons when it is null) are {[float(e) for e in epsilons]}. Give one of them.")
    return [CellSetup(
        method=m, epsilon=e, canaries=int(params["canaries"]), group_size=int(params["group_size"]),
        sampling_rate=float(params["sampling_rate"]), steps=int(params["steps"]),
        delta=float(params["delta"]), clip_norm=float(params["clip_norm"]),
        other_users=int(params["other_users"]), example_length=int(params["example_length"]),
        clipping=params["clipping"], confidence=float(params["confidence"]),
        guess_fractions=tuple(params["guess_fractions"]), seed=int(params["seed"]),
        processes=int(params["processes"]), physical_batch_size=int(params["physical_batch_size"]),
        adaptive=None if params.get("adaptive") is None else AdaptiveClipping.from_record(
            params["adaptive"]), bands=int(params.get("bands", 1)) if m == "uls" else 1)
        for m in methods for e in epsilons
        if (method is None or m == method) and (epsilon is None or math.isclose(float(epsilon), e, rel_tol=1e-9))]


def run_audit(params: Mapping[str, Any], dataset: str = "", *, method: str | None = None,
              epsilon: float | None = None, threads: int = 1) -> list[dict[str, Any]]:
    """Audit every selected cell (one process, or `processes` torchrun workers per cell); their rows."""
    import json

    settings = {"optimizer": params["optimizer"], "schedule": params["schedule"]}
    rows = []
    for setup in select_cells(params, method, epsilon):
        ceiling = bound_ceiling(setup.canaries, setup.delta, setup.confidence, setup.guess_fractions,
                                gaussian=gaussian_release(setup.sampling_rate))
        if ceiling <= setup.epsilon:
            log.warning("%s eps %g: this audit cannot show a bound above the claim: the largest bound possible with "
                        "%d canaries at delta %.3g and confidence %g is %.4g (every guess right). Use more canaries "
                        "(audit.mechanism.canaries) or a smaller delta (audit.mechanism.delta).", setup.method,
                        setup.epsilon, setup.canaries, setup.delta, setup.confidence, ceiling)
        if setup.processes <= 1:
            row = audit_cell(setup, settings=settings, dataset=dataset)
        else:
            from ..training import distributed

            with tempfile.TemporaryDirectory() as tmp:
                job, out = Path(tmp) / "cell.json", Path(tmp) / "row.json"
                job.write_text(json.dumps({"setup": dataclasses.asdict(setup), "settings": settings,
                                           "dataset": dataset, "out": str(out)}), encoding="utf-8")
                distributed.launch_torchrun(setup.processes, __name__, ["--job", str(job)],
                                            threads_per_process=max(1, int(threads) // setup.processes))
                row = json.loads(out.read_text(encoding="utf-8"))
        log.info("%s eps %g (claimed %.4g): empirical lower bound %.4g (ceiling %.4g), f-DP bound %.4g (ceiling "
                 "%.4g; NaN: q < 1), %d canaries, %d process(es)", row["method"], row["epsilon_target"],
                 row["epsilon_claimed"], row["epsilon_lower_bound"], row["epsilon_lower_bound_ceiling"],
                 row["epsilon_lower_bound_fdp"], row["epsilon_lower_bound_fdp_ceiling"], row["canaries"],
                 setup.processes)
        rows.append(row)
    return rows


def write_table(rows: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """mechanism.csv: COLUMNS first (in order), then any other field of the rows."""
    import pandas as pd

    from ..io import atomic_path

    df = pd.DataFrame([dict(r) for r in rows])
    df = df.reindex(columns=list(COLUMNS) + [c for c in df.columns if c not in COLUMNS])
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def _worker(argv: Sequence[str] | None = None) -> None:
    """torchrun worker: `python -m userdp.evaluation.mechanism_audit --job FILE` (rank 0 writes the row)."""
    import argparse
    import json

    from ..io import write_json
    from ..training import distributed

    parser = argparse.ArgumentParser(prog=__name__, description="One worker of a several-process mechanism audit.")
    parser.add_argument("--job", required=True)
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    setup = CellSetup(**{**job["setup"], "guess_fractions": tuple(job["setup"]["guess_fractions"])})
    ctx = distributed.init_from_env("cpu")
    try:
        row = audit_cell(setup, settings=job["settings"], dist=ctx, dataset=job["dataset"])
        if row is not None:
            write_json(job["out"], row)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    _worker()
