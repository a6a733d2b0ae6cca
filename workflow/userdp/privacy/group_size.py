"""Choosing the contribution bound G (method.md section 7).

* ELS (the study's heuristic): G = median of the train users' example counts
  (rounded up to a whole number).
* ULS: this project's instantiation of the study's noise/utility prediction,
  the predicted signal-to-noise ratio
      SNR(G) = M(G) * mean_u rho(min(n_u, G)) / sigma(G),
  with M(G) = K / (T * mbar_G) users per step under the compute budget,
  sigma(G) the calibrated ULS noise at q_u = M(G) / N, and
  rho(m) = 1 / sqrt(1 + r / m) the fraction of an average of m example
  gradients that survives clipping when the per-example gradient
  noise-to-signal ratio is r (`privacy.group_size.snr_noise_ratio`).
  Candidates are powers of two up to the `snr_max_quantile` quantile of the
  counts; the argmax wins (ties: the smaller G).
* An explicit integer G, or a G sweep, bypasses both rules.

The counts are statistics of private data. Like the study we treat them as
public by default (docs/privacy.md says so); dataset sizes are treated as
public too. With `privacy.contribution_stats.private` the rules read a DP
histogram of the counts instead (`contribution_stats.NoisyHistogram`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import PrivacyError
from .calibration import calibrate

if TYPE_CHECKING:
    from .contribution_stats import NoisyHistogram


@dataclasses.dataclass(frozen=True)
class BoundedStats:
    """The pool after bounding each user to G examples."""

    group_size: int
    n_users: int
    n_examples: int  # N_G = sum_u min(n_u, G)
    mean_contribution: float  # mbar_G = N_G / N


def bounded_stats(counts: Sequence[int] | np.ndarray, group_size: int) -> BoundedStats:
    """N_G and mbar_G for contribution bound G."""
    c = np.asarray(counts, dtype=np.int64)
    if c.size == 0:
        raise PrivacyError("no train users: cannot bound contributions or plan a run.")
    m = np.minimum(c, int(group_size))
    return BoundedStats(int(group_size), int(c.size), int(m.sum()), float(m.mean()))


def median_group_size(counts: Sequence[int] | np.ndarray) -> int:
    """ELS heuristic: the median number of examples per train user, rounded up."""
    c = np.asarray(counts, dtype=float)
    if c.size == 0:
        raise PrivacyError("no train users: the median contribution is undefined.")
    return max(1, int(math.ceil(float(np.median(c)))))


def snr_candidates(counts: Sequence[int] | np.ndarray, max_quantile: float) -> list[int]:
    """Powers of two from 1 up to the `max_quantile` quantile of the counts."""
    cap = max(1.0, float(np.quantile(np.asarray(counts, dtype=float), max_quantile)))
    out, g = [], 1
    while g <= cap:
        out.append(g)
        g *= 2
    return out


def clipping_survival(m: np.ndarray | float, noise_ratio: float) -> np.ndarray:
    """rho(m) = 1 / sqrt(1 + r / m): the signal kept by clipping an average of m gradients."""
    return 1.0 / np.sqrt(1.0 + noise_ratio / np.asarray(m, dtype=float))


@dataclasses.dataclass
class SnrChoice:
    """The chosen G and the prediction for every candidate (written to the plan)."""

    group_size: int
    table: list[dict]


def snr_group_size(
    counts: Sequence[int] | np.ndarray,
    compute_budget: float,
    steps: int,
    epsilon: float,
    delta: float,
    *,
    noise_ratio: float = 1.0,
    max_quantile: float = 0.99,
    tolerance: float = 1e-3,
    max_noise_multiplier: float = 500.0,
    cell: str | None = None,
    histogram: "NoisyHistogram | None" = None,
    extra_events: Sequence = (),
) -> SnrChoice:
    """ULS rule: the G in the candidates with the largest predicted SNR.

    Candidates whose cohort sampling rate would exceed 1, or whose epsilon no
    noise level reaches, are skipped (and listed with their reason).
    histogram: the DP contribution statistics; when given, candidates,
    mbar_G and mean rho(min(n_u, G)) come from it alone and `counts` only
    gives N (a public dataset size). extra_events: fixed releases composed
    into each candidate's sigma (the statistics' Laplace event).
    """
    c = np.asarray(counts, dtype=np.int64)
    N = c.size
    table: list[dict] = []
    candidates = histogram.snr_candidates(max_quantile) if histogram is not None else snr_candidates(c, max_quantile)
    for G in candidates:
        mean_contribution = histogram.mean_bounded(G) if histogram is not None else bounded_stats(c, G).mean_contribution
        M = compute_budget / (steps * mean_contribution)
        q_u = M / N
        row = {"group_size": G, "mean_bounded_contribution": mean_contribution, "expected_batch": M, "sampling_rate": q_u}
        if q_u > 1:
            row.update(noise_multiplier=None, snr=None, skipped="sampling rate > 1")
            table.append(row)
            continue
        if math.isinf(epsilon):
            sigma = 0.0
        else:
            try:
                # A prediction needs sigma to ~0.3 %, not the plan's 1e-3 at
                # discretization 1e-4: calibrate at 1e-3 (pessimistic, ~10x
                # cheaper). The chosen G is calibrated again at full precision.
                sigma = calibrate(
                    "uls", epsilon, delta, q_u, steps, tolerance=max(tolerance, 3e-3),
                    max_noise_multiplier=max_noise_multiplier, discretization=1e-3, extra_events=extra_events,
                ).noise_multiplier
            except PrivacyError as exc:
                row.update(noise_multiplier=None, snr=None, skipped=str(exc))
                table.append(row)
                continue
        survival = (histogram.mean_survival(G, noise_ratio) if histogram is not None
                    else float(clipping_survival(np.minimum(c, G), noise_ratio).mean()))
        signal = M * survival
        snr = signal / sigma if sigma > 0 else math.inf
        row.update(noise_multiplier=sigma, snr=snr, skipped=None)
        table.append(row)
    valid = [r for r in table if r["snr"] is not None]
    if not valid:
        where = f" for {cell}" if cell else ""
        raise PrivacyError(
            f"the SNR rule found no feasible G{where}: {[(r['group_size'], r['skipped']) for r in table]}. "
            "Use more steps or a smaller compute budget, or set privacy.group_size.uls to an integer."
        )
    if math.isinf(epsilon):
        # Without noise SNR is infinite for every G: take the largest feasible
        # candidate (the most data per user); the planner normally passes a
        # finite reference epsilon instead (see planner.plan_cell).
        best = max(valid, key=lambda r: r["group_size"])
    else:
        best = max(valid, key=lambda r: (r["snr"], -r["group_size"]))
    return SnrChoice(int(best["group_size"]), table)
