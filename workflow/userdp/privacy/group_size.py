"""Choosing the contribution bound G (docs/method.md section 7).

* ELS (the study's heuristic): G = the median of the train users' example
  counts (`Contributions.median_group_size`: the lower median, a count some
  user has).
* ULS: this project's instantiation of the study's noise/utility prediction,
  the predicted signal-to-noise ratio
      SNR(G) = M(G) * mean_u rho(min(n_u, G)) / sigma(G),
  with M(G) = K / (T * mbar_G) users per step under the compute budget
  (`ULS.sampling_for_budget`), sigma(G) the calibrated ULS noise at
  q_u = M(G) / N, and rho(m) = 1 / sqrt(1 + r / m) the fraction of an average
  of m example gradients that survives clipping when the per-example gradient
  noise-to-signal ratio is r (`privacy.group_size.snr_noise_ratio`).
  Candidates are powers of two up to the `snr_max_quantile` quantile of the
  counts; the argmax wins (ties: the smaller G).
* An explicit integer G, or a G sweep, bypasses both rules.

The rules read the counts through `contributions.Contributions`: the exact
counts (treated as public by default, like the study; docs/privacy.md says
so) or, with `privacy.contribution_stats.private`, the DP histogram. Dataset
sizes (N, and N_G of the chosen G) are treated as public either way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from ..errors import ConfigError, PrivacyError
from .selection import Selection

if TYPE_CHECKING:  # rule params read `rule_for` at DAG time: the accountants are imported by the rule that uses them
    from .banded import CorrelatedNoise
    from .contributions import Contributions


#: The rule of each method when `privacy.group_size.<method>` is not given (the schema's defaults).
DEFAULT_RULES = {"els": "median", "uls": "snr"}


def rule_for(privacy: dict, method: str):
    """The configured G rule of `method`: "median", "snr" or an integer."""
    return (privacy.get("group_size") or {}).get(method, DEFAULT_RULES[method])


@dataclasses.dataclass
class SnrChoice:
    """The chosen G and the prediction for every candidate (written to the plan)."""

    group_size: int
    table: list[dict]


def snr_group_size(
    contributions: Contributions,
    n_users: int,
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
    selection: "Selection | None" = None,
    min_cohort: float = 1.0,
    correlated: "CorrelatedNoise | None" = None,
) -> SnrChoice:
    """ULS rule: the G in the candidates with the largest predicted SNR.

    Candidates whose cohort sampling rate would exceed 1, whose expected
    cohort M(G) is below `min_cohort` users per step
    (`privacy.group_size.snr_min_cohort`; checked before any calibration),
    or whose calibration is refused (no noise level reaches epsilon, a
    vacuous delta, or the accountant's memory bound) are skipped and listed
    with their reason.
    n_users: N, a public dataset size. The fixed releases of the statistics
    (`contributions.dp_events`) are composed into each candidate's sigma,
    and sigma is each run's under `selection` (the cell's learning-rate runs
    released as one model; default one run). `correlated` (banded DP-FTRL, privacy.correlated_noise): each
    candidate's sigma is that of the mechanism the cell would run, BandedULS at the rate p = b q_u within a
    partition (a candidate with p > 1 is skipped), not DP-SGD's.
    """
    selection = selection or Selection("composed", 1)
    from .calibration import calibrate
    from .mechanism import ULS, cohort_rate, uls_mechanism

    table: list[dict] = []
    for G in contributions.group_size_candidates(max_quantile):
        mean_contribution = contributions.mean_bounded(G)
        s = ULS.sampling_for_budget(compute_budget, steps, n_users, 0, mean_contribution)
        M, q_u = s.expected_batch, s.sampling_rate
        rate = cohort_rate(q_u, correlated)
        row = {"group_size": G, "mean_bounded_contribution": mean_contribution, "expected_batch": M,
               "sampling_rate": rate}
        sigma = snr = skipped = None
        if rate > 1:
            skipped = "sampling rate > 1" + (
                f" (the rate within one of {correlated.bands} partitions)" if correlated else "")
        elif M < min_cohort:
            # Noisy statistics can put weight on huge counts (large G, tiny mbar_G-driven cohorts): such a
            # candidate trains on almost no users per step, and its calibration nears a vacuous delta.
            skipped = f"expected cohort {M:.3g} users per step < privacy.group_size.snr_min_cohort = {min_cohort:g}"
        elif math.isinf(epsilon):
            sigma = 0.0
        else:
            try:
                # A prediction needs sigma to ~0.3 %, not the plan's 1e-3 at
                # discretization 1e-4: calibrate at 1e-3 (pessimistic, ~10x
                # cheaper). The chosen G is calibrated again at full precision.
                sigma = calibrate(
                    selection.calibration_mechanism(uls_mechanism(q_u, int(steps), 1, correlated)), epsilon,
                    delta, tolerance=max(tolerance, 3e-3),
                    max_noise_multiplier=max_noise_multiplier, discretization=1e-3,
                    extra_events=contributions.dp_events,
                ).noise_multiplier
            except PrivacyError as exc:
                skipped = str(exc)
        if skipped is None:
            signal = M * contributions.mean_survival(G, noise_ratio)
            snr = signal / sigma if sigma > 0 else math.inf
        row.update(noise_multiplier=sigma, snr=snr, skipped=skipped)
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


def choose_group_size(
    method: str,
    contributions: Contributions,
    n_users: int,
    privacy: dict,
    *,
    compute_budget: int,
    steps: int,
    epsilon: float,
    delta: float,
    explicit: int | None = None,
    cell: str | None = None,
    selection: "Selection | None" = None,
    correlated: "CorrelatedNoise | None" = None,
) -> tuple[int, str, list[dict] | None]:
    """(G, rule name, SNR candidate table or None) for one cell, by its rule in `privacy.group_size`;
    `correlated`: the cell's banded DP-FTRL (the SNR rule predicts with its mechanism)."""
    if explicit is not None:
        return int(explicit), "explicit (grid.group_size_sweep)", None
    gs = privacy.get("group_size", {}) or {}
    rule = rule_for(privacy, method)
    if isinstance(rule, bool) or not (isinstance(rule, int) or rule in ("median", "snr")):
        raise ConfigError(f"privacy.group_size.{method} is {rule!r}; allowed: median, snr or an integer >= 1.")
    if isinstance(rule, int):
        return int(rule), f"fixed (privacy.group_size.{method} = {rule})", None
    private_stats = bool(contributions.dp_events)
    if rule == "median":
        where = " (DP histogram, lower bin edge)" if private_stats else ""
        return contributions.median_group_size(), f"median of train contributions{where}", None
    if method != "uls":
        raise ConfigError(
            f"privacy.group_size.{method} is 'snr', but the SNR rule is defined for ULS (docs/privacy.md); "
            "use 'median' or an integer for ELS."
        )
    choice = snr_group_size(
        contributions, n_users, compute_budget, steps, epsilon, delta,
        noise_ratio=float(gs.get("snr_noise_ratio", 1.0)),
        max_quantile=float(gs.get("snr_max_quantile", 0.99)),
        min_cohort=float(gs.get("snr_min_cohort", 1.0)),
        tolerance=float(privacy.get("calibration_tolerance", 1e-3)),
        max_noise_multiplier=float(privacy.get("max_noise_multiplier", 500)),
        cell=cell,
        selection=selection,
        correlated=correlated,
    )
    rule = "snr (predicted signal-to-noise, docs/privacy.md)"
    return choice.group_size, rule + (" on the DP histogram" if private_stats else ""), choice.table
