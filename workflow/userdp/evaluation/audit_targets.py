"""Params of the audit rules (workflow/rules/audit.smk), from the config, and the audit's checks before training.

The audit trains each audited cell (userdp.grid.audit_cells) through the
pipeline's own stages: the plan comes from userdp.privacy.planner.plan_cell
with the plan rule's privacy params, the run from rule finetune's script and
params (userdp.training.targets), on the dataset's train rows plus the
included canaries (layout.AUDIT_TOKENS). Paths are layout's AUDIT_* templates.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .. import grid, layout
from ..data.canaries import resolved_secret_length
from ..io import sorted_dict
from ..privacy import targets as plan_targets


def canary_params(config: Mapping) -> dict[str, Any]:
    """What the canaries (and the audit's training table) depend on besides the dataset's tokens."""
    a = config["audit"]
    return sorted_dict({"canaries": a["canaries"], "examples_per_canary": a["examples_per_canary"],
                        "secret_length": resolved_secret_length(config), "seed": a["seed"], "config_seed": config["seed"],
                        "max_train_users": a["max_train_users"], "canary_design": a["canary_design"],
                        "prefix_length": a["prefix_length"], "exposure_candidates": a["exposure_candidates"]})


def grid_delta(privacy: dict, contributions: Mapping) -> tuple[dict, str]:
    """`privacy` with the grid's delta set (privacy.delta, or its rule at the dataset's train users), and how.

    The audit trains on a subset of the users (audit.max_train_users); the
    default rule applied to that subset would give a larger delta than the
    grid cell's, and the one-run bound's delta term grows with it.
    """
    from ..privacy.planner import resolve_delta

    if privacy.get("delta") is not None:
        return privacy, "privacy.delta"
    n = int((contributions.get("n_users") or {}).get("train") or 0)
    if n < 1:
        raise ValueError("contributions.json has no train users (n_users.train); rebuild the data stage")
    delta, rule = resolve_delta(privacy, n)
    return {**privacy, "delta": delta}, f"{rule} with N = {n}, the dataset's train users (the grid cells' delta)"


#: The privacy params of an audit plan (config, method, eps): those of the grid's plan rule for the same cell.
plan_privacy = plan_targets.plan_privacy_params


def reference_epsilon(config: Mapping, method: str, eps: str) -> float | None:
    """For a non-private audited cell whose G comes from the SNR rule (or DP statistics): the largest audit epsilon."""
    if eps != "inf" or plan_targets.reference_epsilon_param(config, method, eps) is None:
        return None
    finite = grid.audit_epsilons(config)
    return max(finite) if finite else plan_targets.reference_epsilon_param(config, method, eps)


def score_params(config: Mapping) -> dict[str, Any]:
    """What an audit result depends on besides its input files: the bound's confidence, guess sets and delta."""
    a = config["audit"]
    return sorted_dict({"confidence": a["confidence"], "guess_fractions": list(a["guess_fractions"]),
                        "delta": a["delta"]})


#: What the audit's ceiling depends on (rule audit_plan's script checks it before training): m, the confidence,
#: the guess sets and audit.delta (null: the run's delta, known once the plan has it). Read from the config, not
#: params (userdp.untracked): the check refuses or warns but changes no plan, so these keys rerun no plan and no
#: run.
CEILING_UNTRACKED_KEYS = ("audit.canaries", "audit.confidence", "audit.guess_fractions", "audit.delta")


#: The audit delta the fix suggests when the runs' delta leaves the audit nothing to show.
SUGGESTED_DELTA = 1e-6
#: A ceiling below this cannot tell a leaking model from one that leaks nothing measurable (it is the one-run
#: bound of about 5 all-correct guesses at 95%), so the audit warns.
USEFUL_CEILING = 1.0


def ceiling_check(ceiling: Mapping[str, float], *, canaries: int, delta: float, audit_delta_set: bool,
                  epsilon_target: float, suggestion: Mapping[str, float] | None = None) -> tuple[str, str | None]:
    """("error" | "warning" | "ok", message): whether an audit with these ceilings can show anything.

    error: neither estimator can show a bound above 0 (the audit would only
    ever report 0); warning: the (epsilon, delta) bound cannot exceed
    USEFUL_CEILING, or no bound can exceed the cell's target epsilon (the
    audit cannot catch a mechanism that breaks its claim). `suggestion`:
    the ceilings at a smaller delta, quoted in the fix.
    """
    one_run, fdp = ceiling["epsilon_lower_bound_ceiling"], ceiling["epsilon_lower_bound_fdp_ceiling"]
    which = "audit.delta" if audit_delta_set else "the runs' delta (audit.delta: null)"
    fix = (f"audit with a smaller delta (audit.delta: {SUGGESTED_DELTA:g}, the audit's own delta: the bound then "
           f"tests the runs' epsilon at that delta"
           + (f", where the ceilings are {suggestion['epsilon_lower_bound_ceiling']:.3g} and "
              f"{suggestion['epsilon_lower_bound_fdp_ceiling']:.3g}" if suggestion else "")
           + ") or with fewer canaries (audit.canaries; the 2 m delta term shrinks with m), or more canaries at a "
           "small delta (the ceiling grows with the guesses)")
    head = f"at delta = {delta:.3g} ({which}) and {canaries} canaries"
    if one_run <= 0 and fdp <= 0:
        return "error", f"{head} no bound above 0 is possible with either estimator: {fix}."
    if one_run < USEFUL_CEILING:
        return "warning", (f"{head} the (epsilon, delta) one-run bound cannot exceed {one_run:.3g} (the f-DP bound, "
                           f"which assumes a Gaussian trade-off curve, {fdp:.3g}): {fix}.")
    if math.isfinite(epsilon_target) and max(one_run, fdp) < epsilon_target:
        return "warning", (f"{head} no bound can exceed {max(one_run, fdp):.3g}, below the target epsilon "
                           f"{epsilon_target:g}: this audit cannot catch a mechanism that breaks its claim (it can "
                           f"still show leakage); more canaries raise the ceiling.")
    return "ok", None


def plan_time_check(audit: Mapping, run_delta: float, *, dataset: str, method: str,
                    eps: str) -> tuple[dict, str | None]:
    """Rule audit_plan's check, before training: (the ceilings at the audit's delta, a warning or None).

    `audit`: the audit section of CEILING_UNTRACKED_KEYS' (m, confidence, guess fractions,
    audit.delta); `run_delta`: the runs' delta (the plan's). Raises
    ConfigError, naming the fix, when no bound above 0 is possible.
    """
    from ..errors import ConfigError
    from .audit import ceilings

    delta = float(audit["delta"]) if audit["delta"] is not None else float(run_delta)
    m, conf, fractions = int(audit["canaries"]), float(audit["confidence"]), list(audit["guess_fractions"])
    ceiling = ceilings(m, delta, conf, fractions)
    suggestion = ceilings(m, SUGGESTED_DELTA, conf, fractions) if delta > SUGGESTED_DELTA else None
    status, message = ceiling_check(ceiling, canaries=m, delta=delta, audit_delta_set=audit["delta"] is not None,
                                    epsilon_target=layout.parse_num(eps), suggestion=suggestion)
    where = f"the audit of {dataset} ({method}, eps {eps})"
    if status == "error":
        raise ConfigError(f"{where}: {message}")
    return {**ceiling, "delta": delta}, (f"{where}: {message}" if message else None)
