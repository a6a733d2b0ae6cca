"""The planner: one grid cell (method, epsilon, compute budget K) -> a training plan.

Given K and the step count T configured for the budget (method.md section 5):

* ELS: G by its rule, expected batch B = K / T examples, sampling rate
  q = B / N_G over the bounded pool of N_G examples.
* ULS: G by its rule (it changes mbar_G, so it comes first), expected cohort
  M = K / (T * mbar_G) users, q_u = M / N_train_users.

Then sigma is calibrated to (epsilon, delta). Expected compute, T * q * N_G
(ELS) or T * q_u * N * mbar_G (ULS), equals K by construction; the plan
records it so training can report realised / expected.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError, PrivacyError
from . import accounting
from .calibration import calibrate
from .group_size import bounded_stats, median_group_size, snr_group_size


def default_delta(n_train_users: int, exponent: float = 1.1) -> float:
    """delta = 1 / N^exponent (method.md section 1)."""
    return 1.0 / float(n_train_users) ** exponent


def cell_label(dataset: str, method: str, epsilon: float, compute_budget: int, group_size: int | None = None) -> str:
    """How errors name a cell: the same axes as its plan path."""
    from ..config import fmt_num

    label = f"cell dataset={dataset} method={method} eps={fmt_num(epsilon)} budget={compute_budget}"
    return label + (f" group={group_size}" if group_size else "")


def resolve_delta(privacy: dict, n_train_users: int) -> tuple[float, str]:
    """delta from config (privacy.delta) or the default rule; and how it was set."""
    if privacy.get("delta") is not None:
        return float(privacy["delta"]), "privacy.delta"
    exp = float(privacy.get("delta_exponent", 1.1))
    return default_delta(n_train_users, exp), f"1/N_train_users^{exp:g}"


def choose_group_size(
    method: str,
    counts: np.ndarray,
    privacy: dict,
    *,
    compute_budget: int,
    steps: int,
    epsilon: float,
    delta: float,
    explicit: int | None = None,
    cell: str | None = None,
) -> tuple[int, str, list[dict] | None]:
    """(G, rule name, SNR candidate table or None) for one cell."""
    if explicit is not None:
        return int(explicit), "explicit (grid.group_size_sweep)", None
    gs = privacy.get("group_size", {}) or {}
    rule = gs.get(method, "median" if method == "els" else "snr")
    if isinstance(rule, bool) or not (isinstance(rule, int) or rule in ("median", "snr")):
        raise ConfigError(f"privacy.group_size.{method} is {rule!r}; allowed: median, snr or an integer >= 1.")
    if isinstance(rule, int):
        return int(rule), f"fixed (privacy.group_size.{method} = {rule})", None
    if rule == "median":
        return median_group_size(counts), "median of train contributions", None
    if method == "els":
        raise ConfigError(
            "privacy.group_size.els is 'snr', but the SNR rule is defined for ULS (docs/privacy.md); "
            "use 'median' or an integer for ELS."
        )
    choice = snr_group_size(
        counts,
        compute_budget,
        steps,
        epsilon,
        delta,
        noise_ratio=float(gs.get("snr_noise_ratio", 1.0)),
        max_quantile=float(gs.get("snr_max_quantile", 0.99)),
        tolerance=float(privacy.get("calibration_tolerance", 1e-3)),
        max_noise_multiplier=float(privacy.get("max_noise_multiplier", 500)),
        cell=cell,
    )
    return choice.group_size, "snr (predicted signal-to-noise, docs/privacy.md)", choice.table


def plan_cell(
    *,
    dataset: str,
    method: str,
    epsilon: float,
    compute_budget: int,
    steps: int,
    counts: Sequence[int] | np.ndarray,
    privacy: dict,
    group_size: int | None = None,
    reference_epsilon: float | None = None,
) -> dict[str, Any]:
    """The plan of one grid cell (the plan JSON of artifacts.md).

    counts: example counts n_u of the train users (their contributions).
    group_size: an explicit G (G-sweep cells); otherwise the configured rule.
    reference_epsilon: for the non-private cell (epsilon = inf), the finite
    epsilon whose SNR choice of G the reference reuses (the loosest grid
    epsilon), so the reference trains on the pool a private run would use.
    """
    counts = np.asarray(counts, dtype=np.int64)
    cell = cell_label(dataset, method, epsilon, compute_budget, group_size)
    if method not in accounting.METHODS:
        raise ConfigError(f"{cell}: method {method!r} is not one of {accounting.METHODS}.")
    if steps < 1 or compute_budget < 1:
        raise ConfigError(f"{cell}: grid.budgets needs compute >= 1 and steps >= 1 (got {compute_budget}, {steps}).")
    n_users = int(counts.size)
    if n_users == 0:
        raise PrivacyError(f"{cell}: the dataset has no train users; check the data split.")
    delta, delta_rule = resolve_delta(privacy, n_users)
    private = not math.isinf(epsilon)
    eps_for_g = epsilon if private or reference_epsilon is None else float(reference_epsilon)
    G, rule, table = choose_group_size(
        method, counts, privacy, compute_budget=compute_budget, steps=steps, epsilon=eps_for_g,
        delta=delta, explicit=group_size, cell=cell,
    )
    st = bounded_stats(counts, G)
    if method == "els":
        expected_batch = compute_budget / steps
        q = expected_batch / st.n_examples
        expected_compute = steps * q * st.n_examples
        unit, pool = "examples", f"N_G = {st.n_examples} bounded examples"
    else:
        expected_batch = compute_budget / (steps * st.mean_contribution)
        q = expected_batch / n_users
        expected_compute = steps * q * n_users * st.mean_contribution
        unit, pool = "users", f"{n_users} train users"
    if q > 1:
        raise PrivacyError(
            f"{cell}: sampling rate {q:.4g} > 1 (expected batch {expected_batch:.4g} {unit} per step from "
            f"{pool}, G = {G}). Use more steps for this budget in grid.budgets or a smaller compute budget."
        )
    tolerance = float(privacy.get("calibration_tolerance", 1e-3))
    max_noise = float(privacy.get("max_noise_multiplier", 500))
    if private:
        cal = calibrate(
            method, epsilon, delta, q, steps, G, tolerance=tolerance, max_noise_multiplier=max_noise, cell=cell
        )
        sigma, eps_ach = cal.noise_multiplier, cal.epsilon_achieved
        calibration = {
            "tolerance": tolerance,
            "discretization": cal.discretization,
            "noise_lower": cal.noise_lower,
            "evaluations": cal.evaluations,
            "seconds": round(cal.seconds, 3),
        }
        clip_norm, clipping, accountant = float(privacy.get("clip_norm", 1.0)), privacy.get("clipping", "flat"), accounting.accountant_name(method)
    else:
        sigma, eps_ach, calibration = 0.0, math.inf, None
        clip_norm, clipping, accountant = None, None, "none (non-private reference)"
    plan: dict[str, Any] = {
        "dataset": dataset,
        "method": method,
        "epsilon": float(epsilon),
        "delta": delta,
        "delta_rule": delta_rule,
        "group_size": G,
        "group_size_rule": rule,
        "sampling_rate": q,
        "steps": int(steps),
        "expected_batch": expected_batch,
        "expected_batch_unit": unit,
        "noise_multiplier": sigma,
        "epsilon_achieved": eps_ach,
        "compute_budget": int(compute_budget),
        "expected_compute": expected_compute,
        "accountant": accountant,
        "clip_norm": clip_norm,
        "clipping": clipping,
        "n_train_users": n_users,
        "n_train_examples": int(counts.sum()),
        "n_train_examples_bounded": st.n_examples,
        "mean_bounded_contribution": st.mean_contribution,
        "calibration": calibration,
        "contribution_statistics": "treated as public (docs/privacy.md)",
        "library_versions": accounting.library_versions(),
    }
    if table is not None:
        plan["group_size_candidates"] = table
        if not private:
            plan["group_size_reference_epsilon"] = eps_for_g
    return plan


def read_train_counts(users_path: str) -> np.ndarray:
    """Example counts of the train users from results/data/{dataset}/users.parquet."""
    import pyarrow.parquet as pq

    from ..errors import DataError

    try:
        table = pq.read_table(users_path, columns=["user_id", "split", "n_examples"])
    except FileNotFoundError as exc:
        raise DataError(f"{users_path} does not exist; run the data rules first.") from exc
    except (KeyError, ValueError) as exc:  # missing columns, not Parquet
        raise DataError(f"{users_path} must be Parquet with columns user_id, split, n_examples: {exc}") from exc
    df = table.to_pandas()
    counts = df.loc[df["split"] == "train", "n_examples"].to_numpy(dtype=np.int64)
    if counts.size == 0:
        raise DataError(f"{users_path} has no users with split == 'train'.")
    if (counts < 1).any():
        raise DataError(f"{users_path}: {int((counts < 1).sum())} train users have n_examples < 1.")
    return counts
