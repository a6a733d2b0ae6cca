"""The privacy ledger: the mechanism a run actually executed, and its epsilon.

Training records WHAT ran (method, sampling rate, noise multiplier, clip
norm, G, steps completed, delta); epsilon is then recomputed from those
values by the accountant alone, as dp-accounting separates events from
accountants. For a complete run it must equal the plan's epsilon_achieved;
a mismatch means training ran a different mechanism than was planned.
When the plan spent part of its epsilon on DP contribution statistics
(`contribution_stats`), the ledger records that release too and its epsilon
composes it with the steps, as the plan's calibration did.
"""

from __future__ import annotations

import math
import platform
from importlib import metadata
from typing import Any, Callable

MECHANISM_FIELDS = (
    "method", "sampling_rate", "noise_multiplier", "clip_norm", "clipping", "group_size", "delta", "accountant",
)


def library_versions() -> dict[str, str]:
    """Versions of the libraries that determine the mechanism and the model."""
    out = {"python": platform.python_version()}
    for dist, key in (("torch", "torch"), ("transformers", "transformers"), ("dp-accounting", "dp_accounting"),
                      ("userdp", "userdp"), ("numpy", "numpy")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = "unknown"
    return out


def _default_compute_epsilon() -> Callable[..., float]:
    from ..privacy.accounting import compute_epsilon

    return compute_epsilon


def recompute_epsilon(
    method: str,
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    group_size: int,
    compute_epsilon: Callable[..., float] | None = None,
    contribution_stats: dict | None = None,
) -> float:
    """Epsilon of `steps` steps of the mechanism; inf when there is no noise.

    ULS accounting does not depend on G (a sampled user is one clipped unit),
    so G is passed only for ELS. contribution_stats: the plan's record of the
    DP contribution statistics release, if any; its DP event is composed with
    the steps (it was spent whatever the number of steps, so 0 steps give its
    epsilon alone).
    """
    from ..privacy.contribution_stats import events_from_record

    extra = events_from_record(contribution_stats)
    if noise_multiplier <= 0 and steps > 0:
        return math.inf
    if steps <= 0 and not extra:
        return 0.0
    fn = compute_epsilon or _default_compute_epsilon()
    kwargs = {"extra_events": extra} if extra else {}  # injected stand-ins need not know the keyword
    return float(fn(method, noise_multiplier, sampling_rate, max(int(steps), 0), delta,
                    group_size=group_size if method == "els" else 1, **kwargs))


def build_ledger(
    plan: dict[str, Any],
    *,
    steps_completed: int,
    expected_batch: float,
    n_train_users: int,
    n_pool_examples: int,
    examples_processed: int,
    users_processed: int,
    learning_rate: float,
    training: dict[str, Any],
    seeds: dict[str, int],
    resumed_at: list[int],
    compute_epsilon: Callable[..., float] | None = None,
) -> dict[str, Any]:
    """The ledger.json record of a run (fields: artifacts.md, Runs)."""
    noise = float(plan.get("noise_multiplier") or 0.0)
    delta = float(plan["delta"])
    stats = plan.get("contribution_stats")
    eps = recompute_epsilon(
        plan["method"], noise, float(plan["sampling_rate"]), steps_completed, delta, int(plan["group_size"]),
        compute_epsilon=compute_epsilon, contribution_stats=stats,
    )
    budget = plan.get("compute_budget")
    ledger = {
        "method": plan["method"],
        "sampling_rate": float(plan["sampling_rate"]),
        "noise_multiplier": noise,
        "clip_norm": plan.get("clip_norm"),
        "clipping": plan.get("clipping", "flat"),
        "group_size": int(plan["group_size"]),
        "steps_completed": int(steps_completed),
        "steps_planned": int(plan["steps"]),
        "complete": int(steps_completed) == int(plan["steps"]),
        "delta": delta,
        "accountant": plan.get("accountant"),
        "epsilon": eps,
        "epsilon_planned": plan.get("epsilon"),
        "epsilon_plan_achieved": plan.get("epsilon_achieved"),
        "expected_batch": float(expected_batch),
        "expected_batch_planned": plan.get("expected_batch"),
        "n_train_users": int(n_train_users),
        "n_pool_examples": int(n_pool_examples),
        "examples_processed": int(examples_processed),
        "users_processed": int(users_processed),
        "compute_budget": budget,
        "compute_ratio": (examples_processed / float(budget)) if budget else None,
        "learning_rate": float(learning_rate),
        "optimizer": training.get("optimizer"),
        "schedule": training.get("schedule"),
        "warmup_steps": training.get("warmup_steps"),
        "physical_batch_size": training.get("physical_batch_size"),
        "uls_examples_per_user": training.get("uls_examples_per_user"),
        "seed": seeds.get("run"),
        "seeds": seeds,
        "resumed_at_steps": list(resumed_at),
        "versions": library_versions(),
    }
    if stats:
        # The DP contribution statistics release is part of the run's guarantee:
        # `epsilon` above composes its event with the steps (docs/privacy.md).
        ledger["contribution_stats"] = {k: stats.get(k) for k in ("private", "mechanism", "epsilon", "dp_event", "file")}
    return ledger
