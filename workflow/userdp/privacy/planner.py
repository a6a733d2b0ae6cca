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
from . import accounting, contribution_stats
from .calibration import calibrate
from .contribution_stats import NoisyHistogram
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
    histogram: NoisyHistogram | None = None,
) -> tuple[int, str, list[dict] | None]:
    """(G, rule name, SNR candidate table or None) for one cell.

    histogram: the DP contribution statistics; when given, the median and SNR
    rules read it instead of `counts` (which then only give N).
    """
    if explicit is not None:
        return int(explicit), "explicit (grid.group_size_sweep)", None
    gs = privacy.get("group_size", {}) or {}
    rule = gs.get(method, "median" if method == "els" else "snr")
    if isinstance(rule, bool) or not (isinstance(rule, int) or rule in ("median", "snr")):
        raise ConfigError(f"privacy.group_size.{method} is {rule!r}; allowed: median, snr or an integer >= 1.")
    if isinstance(rule, int):
        return int(rule), f"fixed (privacy.group_size.{method} = {rule})", None
    if rule == "median":
        if histogram is not None:
            return histogram.median_group_size(), "median of train contributions (DP histogram, lower bin edge)", None
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
        histogram=histogram,
        extra_events=(histogram.dp_event(),) if histogram is not None else (),
    )
    rule = "snr (predicted signal-to-noise, docs/privacy.md)"
    return choice.group_size, rule + (" on the DP histogram" if histogram is not None else ""), choice.table


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
    stats: NoisyHistogram | None = None,
) -> dict[str, Any]:
    """The plan of one grid cell (the plan JSON of artifacts.md).

    counts: example counts n_u of the train users (their contributions).
    group_size: an explicit G (G-sweep cells); otherwise the configured rule.
    reference_epsilon: for the non-private cell (epsilon = inf), the finite
    epsilon whose SNR choice of G the reference reuses (the loosest grid
    epsilon), so the reference trains on the pool a private run would use.
    stats: the DP contribution statistics release (required when
    `privacy.contribution_stats.private`): the G rules read it instead of the
    counts, and its Laplace event is composed into the calibration, so
    `epsilon` is the total of the release and the T steps. N_G and mbar_G of
    the chosen G stay exact (dataset sizes after bounding are public).
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
    stats_settings = contribution_stats.settings(privacy)
    if stats_settings is not None and stats is None:
        raise PrivacyError(
            f"{cell}: {contribution_stats.KEY}.private is true but no DP contribution statistics were given; "
            "the plan rule reads them from results/data/{dataset}/contributions_dp.json (rule contribution_stats_dp)."
        )
    if stats is not None and stats_settings is None:
        raise PrivacyError(
            f"{cell}: DP contribution statistics were given but {contribution_stats.KEY}.private is false; "
            "turn the option on or plan without them."
        )
    extra_events: tuple = ()
    if stats is not None:
        contribution_stats.check_budget(stats.epsilon, epsilon, cell)
        if eps_for_g != epsilon:
            contribution_stats.check_budget(stats.epsilon, eps_for_g, cell + " (reference epsilon for G)")
        extra_events = (stats.dp_event(),)
    G, rule, table = choose_group_size(
        method, counts, privacy, compute_budget=compute_budget, steps=steps, epsilon=eps_for_g,
        delta=delta, explicit=group_size, cell=cell, histogram=stats,
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
        try:
            cal = calibrate(
                method, epsilon, delta, q, steps, G, tolerance=tolerance, max_noise_multiplier=max_noise, cell=cell,
                extra_events=extra_events,
            )
        except PrivacyError as exc:
            if not extra_events:
                raise
            raise PrivacyError(
                f"{exc} The DP contribution statistics ({contribution_stats.KEY}.epsilon = {stats.epsilon:g}) are "
                f"composed into this cell's epsilon; a smaller {contribution_stats.KEY}.epsilon leaves more for training."
            ) from exc
        sigma, eps_ach = cal.noise_multiplier, cal.epsilon_achieved
        calibration = {
            "tolerance": tolerance,
            "discretization": cal.discretization,
            "noise_lower": cal.noise_lower,
            "evaluations": cal.evaluations,
            "seconds": round(cal.seconds, 3),
        }
        clip_norm, clipping, accountant = float(privacy.get("clip_norm", 1.0)), privacy.get("clipping", "flat"), accounting.accountant_name(method)
        if extra_events:
            accountant += "+" + contribution_stats.ACCOUNTANT_SUFFIX
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
    if stats is not None:
        plan["contribution_statistics"] = (
            "private: Laplace histogram composed into epsilon; dataset sizes N, N_G, mbar_G treated as public "
            "(docs/privacy.md)"
        )
        record = stats.record()
        if private:
            # How the total splits (for reporting): the training steps alone at the plan's sigma.
            record["epsilon_training_only"] = accounting.compute_epsilon(method, sigma, q, steps, delta, G)
        plan["contribution_stats"] = record
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


def read_train_token_counts(tokens_path: str, batch_rows: int = 1 << 18) -> np.ndarray:
    """Rows per train user of results/data/{dataset}/tokens.parquet (chunk mode).

    With `tokenizer.long_examples: chunk` one example becomes several rows
    (windows), and the training pool bounds G over rows; the counts that
    choose G and give N_G / mbar_G must be those rows, not users.parquet's
    examples. Streams the two id columns (column projection, no pre-buffer):
    per batch, train rows are counted per user with pyarrow's `value_counts`
    and partial counts are merged with a group-by sum, so memory is bounded by
    one batch plus one (user, count) pair per train user.
    Users are returned in no particular order (the planner only needs the
    multiset of counts).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..errors import DataError
    from ..io import streaming_parquet

    try:
        pf = streaming_parquet(tokens_path)
    except FileNotFoundError as exc:
        raise DataError(f"{tokens_path} does not exist; run the data stage (rule tokenize) first.") from exc
    missing = [c for c in ("user_id", "split") if c not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"{tokens_path} lacks column(s) {missing}; rebuild it with the data stage (rule tokenize).")
    parts: list[pa.Table] = []
    held = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=["user_id", "split"]):
        train = pc.fill_null(pc.equal(batch.column("split"), "train"), False)
        uid = pc.filter(batch.column("user_id"), train)
        if len(uid) == 0:
            continue
        vc = pc.value_counts(uid)
        parts.append(pa.table({"user_id": vc.field("values"), "n": vc.field("counts")}))
        held += len(vc)
        if len(parts) > 1 and held > 4 * batch_rows:  # merge partial counts: memory stays ~ one row per user
            parts = [_sum_counts(parts)]
            held = parts[0].num_rows
    if not parts:
        raise DataError(f"{tokens_path} has no rows with split == 'train'.")
    merged = _sum_counts(parts) if len(parts) > 1 else parts[0]
    return merged.column("n").to_numpy().astype(np.int64)


def _sum_counts(parts: list):
    """One (user_id, n) table from partial per-user counts (group-by sum)."""
    import pyarrow as pa

    t = pa.concat_tables(parts).group_by("user_id").aggregate([("n", "sum")])
    return t.select(["user_id", "n_sum"]).rename_columns(["user_id", "n"])


def read_counts(users: str | None = None, tokens: str | None = None) -> tuple[np.ndarray, str]:
    """Train users' counts and where they came from: tokens.parquet rows when given (chunk mode), else users.parquet."""
    if tokens is not None:
        return read_train_token_counts(str(tokens)), "tokens.parquet rows per train user (tokenizer.long_examples = chunk)"
    if users is None:
        raise ValueError("read_counts needs users.parquet or tokens.parquet")
    return read_train_counts(str(users)), "users.parquet n_examples of train users"



def check_evaluation_users(contributions: dict, dataset: str, where: str) -> None:
    """DataError when the dataset has no validation or no test users (evaluation would fail after training)."""
    from ..errors import DataError

    n_users = contributions.get("n_users") or {}
    empty = [split for split in ("validation", "test") if int(n_users.get(split, 0) or 0) == 0]
    if empty:
        raise DataError(
            f"{where}: dataset {dataset!r} has no {' and no '.join(empty)} users (users per split: "
            f"{dict(n_users)}); the learning rate is chosen on validation users and results are reported on test "
            f"users. The split is a fraction of users (datasets.{dataset}.split.validation / .test), so a small "
            "dataset can get none: raise the fractions or use more users."
        )
