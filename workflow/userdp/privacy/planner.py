"""The planner: one grid cell (method, epsilon, compute budget K) -> a training plan.

Given K and the step count T configured for the budget (docs/method.md section 5):

* ELS: G by its rule, expected batch B = K / T examples, sampling rate
  q = B / N_G over the bounded pool of N_G examples.
* ULS: G by its rule (it changes mbar_G, so it comes first), expected cohort
  M = K / (T * mbar_G) users, q_u = M / N_train_users. With banded DP-FTRL
  (`privacy.correlated_noise`, private ULS cells) the same M comes from one
  partition of b: the rate within it is p = b M / N (userdp.privacy.banded).

Then sigma is calibrated to (epsilon, delta). Expected compute, T * q * N_G
(ELS) or T * q_u * N * mbar_G (ULS), equals K by construction; the plan
records it so training can report realised / expected.

With DP contribution statistics N_G and mbar_G are the DP histogram's
estimates (`planning_sizes`), so the plan holds no exact statistic of the
train users' counts; expected compute is K on those estimates.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError, DataError, PrivacyError
from . import accounting, banded, contribution_stats, mechanism
from . import adaptive as adaptive_lib
from .calibration import calibrate
from .contribution_stats import NoisyHistogram
from .contributions import Contributions, ExactCounts
from .group_size import choose_group_size
from .mechanism import Mechanism, Sampling
from .selection import Selection
from .spec import CALIBRATION_TIMING, PRIVATE_SIZES, RunSpec

log = logging.getLogger(__name__)


def default_delta(n_train_users: int, exponent: float = 1.1) -> float:
    """delta = 1 / N^exponent (docs/method.md section 1)."""
    return 1.0 / float(n_train_users) ** exponent


def cell_label(dataset: str, method: str, epsilon: float, compute_budget: int, group_size: int | None = None) -> str:
    """How errors name a cell: the same axes as its plan path."""
    from ..layout import fmt_num

    label = f"cell dataset={dataset} method={method} eps={fmt_num(epsilon)} budget={compute_budget}"
    return label + (f" group={group_size}" if group_size else "")


def resolve_delta(privacy: dict, n_train_users: int) -> tuple[float, str]:
    """delta from config (privacy.delta) or the default rule; and how it was set."""
    if privacy.get("delta") is not None:
        return float(privacy["delta"]), "privacy.delta"
    exp = float(privacy.get("delta_exponent", 1.1))
    return default_delta(n_train_users, exp), f"1/N_train_users^{exp:g}"


#: delta * N above this is "not well below 1/N" (plan field delta_warning). The default rule 1/N^1.1 crosses it
#: below about 1000 train users (N^-0.1 > 0.5).
DELTA_TIMES_N_WARNING = 0.5


def delta_warning(delta: float, n_train_users: int, rule: str) -> str | None:
    """A warning when delta is not well below 1/N (the usual requirement: a mechanism that leaks one random user's
    data entirely is (0, 1/N)-DP), with how to choose it; None when delta * N <= DELTA_TIMES_N_WARNING."""
    n = int(n_train_users)
    if n < 1 or delta * n <= DELTA_TIMES_N_WARNING:
        return None
    return (f"delta = {delta:.3g} ({rule}) is {delta * n:.2f} / N for N = {n} train users, not well below 1/N: a "
            "mechanism that publishes one random user's data outright is (0, 1/N)-DP, so the guarantee says little "
            f"about any one user. Set privacy.delta well below 1/N (e.g. {0.01 / n:.1g} = 0.01 / N) or raise "
            "privacy.delta_exponent; more users make the default rule 1/N^1.1 safer.")


def group_size_note(method: str, group_size: int, counts: np.ndarray, contributions: Contributions) -> str | None:
    """What a G above every train user's count means for the data at hand (None otherwise, or with DP
    contribution statistics, where the largest count is not public)."""
    if contributions.dp_events or counts.size == 0:
        return None
    largest = int(np.max(counts))
    if group_size <= largest:
        return None
    if method == "els":
        return (f"G = {group_size} but the largest train user has {largest} examples: bounding at G keeps every "
                f"example, yet the accountant charges each user for up to G examples, so noise grows with G for "
                f"nothing; G = {largest} gives the same pool with less noise.")
    return (f"G = {group_size} but the largest train user has {largest} examples: bounding at G keeps every example "
            f"(ULS clips each user to C whatever its size, so privacy is unchanged); G = {largest} trains on the "
            "same data.")


def _contributions(counts: np.ndarray, privacy: dict, stats: NoisyHistogram | None, cell: str,
                   epsilons: tuple[float, ...]) -> Contributions:
    """What the G rules read: the exact counts, or the DP histogram when the option is on (checked)."""
    on = contribution_stats.settings(privacy) is not None
    if on and stats is None:
        raise PrivacyError(
            f"{cell}: {contribution_stats.KEY}.private is true but no DP contribution statistics were given; "
            "the plan rule reads them from results/data/{dataset}/contributions_dp.json (rule contribution_stats_dp)."
        )
    if stats is not None and not on:
        raise PrivacyError(
            f"{cell}: DP contribution statistics were given but {contribution_stats.KEY}.private is false; "
            "turn the option on or plan without them."
        )
    if stats is None:
        return ExactCounts(counts)
    for i, eps in enumerate(dict.fromkeys(epsilons)):
        contribution_stats.check_budget(stats.epsilon, eps, cell + ("" if i == 0 else " (reference epsilon for G)"))
    return stats


def _calibrate(mech: Mechanism, epsilon: float, delta: float, privacy: dict, extra: tuple, cell: str,
               stats: NoisyHistogram | None, selection: Selection) -> tuple[float, float, dict]:
    """(sigma, epsilon achieved, the plan's calibration record) of a private cell.

    Each run's sigma is calibrated so that `selection` (the cell's
    learning-rate runs as one released model) meets the target: the k runs
    composed by default, one run with `privacy.selection.accounting: per_run`.
    """
    tolerance = float(privacy.get("calibration_tolerance", 1e-3))
    try:
        cal = calibrate(selection.calibration_mechanism(mech), epsilon, delta, tolerance=tolerance,
                        max_noise_multiplier=float(privacy.get("max_noise_multiplier", 500)), cell=cell,
                        extra_events=extra)
    except PrivacyError as exc:
        if stats is None:
            raise
        raise PrivacyError(
            f"{exc} The DP contribution statistics ({contribution_stats.KEY}.epsilon = {stats.epsilon:g}) are "
            f"composed into this cell's epsilon; a smaller {contribution_stats.KEY}.epsilon leaves more for training."
        ) from exc
    record = {"tolerance": tolerance, "discretization": cal.discretization, "noise_lower": cal.noise_lower,
              "evaluations": cal.evaluations, CALIBRATION_TIMING: round(cal.seconds, 3)}
    return cal.noise_multiplier, cal.epsilon_achieved, record


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
    selection: Selection | None = None,
) -> RunSpec:
    """The plan of one grid cell: its run specification (JSON: docs/artifacts.md, "Plans").

    counts: example counts n_u of the train users (their contributions).
    group_size: an explicit G (G-sweep cells); otherwise the configured rule.
    reference_epsilon: for the non-private cell (epsilon = inf), the finite
    epsilon whose SNR choice of G the reference reuses (the loosest grid
    epsilon), so the reference trains on the pool a private run would use.
    stats: the DP contribution statistics release (required when
    `privacy.contribution_stats.private`): the G rules read it instead of the
    counts, and its Laplace event is composed into the calibration, so
    `epsilon` is the total of the release and the T steps. N_G and mbar_G of
    the chosen G are then the release's estimates (`planning_sizes`): only N,
    the number of train users, is read from the counts.
    selection: how the cell's learning-rate runs become the released model
    (`privacy.selection`, built by `Selection.from_config`; default: one run).
    By default `epsilon` is the released model's guarantee, so each run is
    calibrated for the selection, not alone; `epsilon_per_run` records one run's.
    """
    selection = selection or Selection("composed", 1)
    counts = np.asarray(counts, dtype=np.int64)
    cell = cell_label(dataset, method, epsilon, compute_budget, group_size)
    if method not in mechanism.METHODS:
        raise ConfigError(f"{cell}: method {method!r} is not one of {tuple(mechanism.METHODS)}.")
    if steps < 1 or compute_budget < 1:
        raise ConfigError(f"{cell}: grid.budgets needs compute >= 1 and steps >= 1 (got {compute_budget}, {steps}).")
    if counts.size == 0:
        raise PrivacyError(f"{cell}: the dataset has no train users; check the data split.")
    delta, delta_rule = resolve_delta(privacy, int(counts.size))
    warn_delta = delta_warning(delta, int(counts.size), delta_rule)
    if warn_delta:
        log.warning("%s: %s", cell, warn_delta)
    private = not math.isinf(epsilon)
    eps_for_g = epsilon if private or reference_epsilon is None else float(reference_epsilon)
    contributions = _contributions(counts, privacy, stats, cell, (epsilon, eps_for_g))
    correlated = banded.of_config(privacy, method) if private else None
    G, rule, table = choose_group_size(method, contributions, int(counts.size), privacy, compute_budget=compute_budget,
                                       steps=steps, epsilon=eps_for_g, delta=delta, explicit=group_size, cell=cell,
                                       selection=selection, correlated=correlated)
    # N_G and mbar_G: exact from the counts, or estimated from the DP release (never the exact counts).
    g_note = group_size_note(method, G, counts, contributions)
    if g_note:
        log.warning("%s: %s", cell, g_note)
    sizes = planning_sizes(contributions, int(counts.size), G)
    mech, sampling = mechanism.get(method).for_budget(compute_budget, steps, G, sizes.n_users, sizes.n_bounded,
                                                      sizes.mean_bounded, where=cell)
    if correlated is not None:  # cyclic Poisson sampling: the same expected batch from one partition of b
        p = mechanism.cohort_rate(sampling.sampling_rate, correlated)
        banded.check_rate(p, correlated.bands, cell)
        mech = mechanism.uls_mechanism(sampling.sampling_rate, int(steps), int(G), correlated)
        sampling = dataclasses.replace(sampling, sampling_rate=p)
    extra = contributions.dp_events
    if private:
        try:
            sigma, eps_ach, calibration = _calibrate(mech, epsilon, delta, privacy, extra, cell, stats, selection)
        except PrivacyError as exc:
            if not g_note:
                raise
            raise PrivacyError(f"{exc} Note: {g_note}") from exc
    else:
        sigma, eps_ach, calibration = 0.0, math.inf, None
    fields = _plan_record(dataset, mech, sampling, epsilon, delta, delta_rule, rule, sigma, eps_ach, compute_budget,
                          privacy, sizes, calibration, extra)
    fields.update(_selection_fields(selection, mech, sigma, eps_ach, delta, extra))
    fields.update(delta_warning=warn_delta, group_size_note=g_note)
    if stats is not None:
        released = stats.record()
        if private:  # how the total splits (for reporting): the training steps alone at the plan's sigma
            released["epsilon_training_only"] = mech.epsilon(sigma, delta)
        fields.update(contribution_stats=released, contribution_statistics=(
            "private: Laplace histogram composed into epsilon; G, N_G and mbar_G come from the histogram, only "
            "the number of train users N is treated as public (docs/privacy.md)"))
    adaptive = adaptive_lib.of_config(privacy) if private else None
    if adaptive is not None:
        try:  # the count's noise must leave some of the step's budget to the gradient (at the planned divisor)
            adaptive.gradient_noise_multiplier(sigma, float(sampling.expected_batch))
        except PrivacyError as exc:
            raise PrivacyError(f"{cell}: {exc}") from None
        fields["adaptive_clipping"] = adaptive.record()
    if correlated is not None:
        fields["correlated_noise"] = correlated.record()
    if table is not None:
        fields["group_size_candidates"] = table
        if not private:
            fields["group_size_reference_epsilon"] = eps_for_g
    return RunSpec(**fields)


def _selection_fields(selection: Selection, mech: Mechanism, sigma: float, eps_ach: float, delta: float,
                      extra: tuple) -> dict[str, Any]:
    """What the plan's epsilon means, and one run's own epsilon next to the selection's."""
    if sigma > 0 and selection.calibration_mechanism(mech) != mech:
        per_run = mech.epsilon(sigma, delta, extra_events=extra)
    else:
        per_run = eps_ach  # one run is the whole selection (or the target is per run)
    return {
        "selection": selection,
        "epsilon_target_of": "released model" if selection.target_is_released else "each learning-rate run",
        "epsilon_per_run": per_run,
    }


def _plan_record(dataset: str, mech: Mechanism, sampling: Sampling, epsilon: float, delta: float, delta_rule: str,
                 rule: str, sigma: float, eps_ach: float, compute_budget: int, privacy: dict, sizes: "PlanningSizes",
                 calibration: dict | None, extra: tuple) -> dict[str, Any]:
    """The plan's fields (docs/artifacts.md), including the calibrated event of the T steps."""
    private = not math.isinf(epsilon)
    accountant = (mech.accountant + ("+" + contribution_stats.ACCOUNTANT_SUFFIX if extra else "") if private
                  else "none (non-private reference)")
    return {
        "dataset": dataset,
        "method": mech.name,
        "epsilon": float(epsilon),
        "delta": delta,
        "delta_rule": delta_rule,
        "group_size": int(mech.group_size),
        "group_size_rule": rule,
        "sampling_rate": mech.sampling_rate,
        "steps": int(mech.steps),
        "expected_batch": sampling.expected_batch,
        "expected_batch_unit": sampling.unit,
        "noise_multiplier": sigma,
        "epsilon_achieved": eps_ach,
        "compute_budget": int(compute_budget),
        "expected_compute": sampling.expected_compute,
        "accountant": accountant,
        "clip_norm": float(privacy.get("clip_norm", 1.0)) if private else None,
        "clipping": privacy.get("clipping", "flat") if private else None,
        "n_train_users": sizes.n_users,
        "n_train_examples": sizes.n_examples,
        "n_train_examples_bounded": sizes.n_bounded,
        "mean_bounded_contribution": sizes.mean_bounded,
        "planning_sizes": sizes.source,
        "calibration": calibration,
        "contribution_statistics": "treated as public (docs/privacy.md)",
        "library_versions": accounting.library_versions(),
        "dp_event": mechanism.event_to_json(mech.dp_event(sigma)),
    }


@dataclasses.dataclass(frozen=True)
class PlanningSizes:
    """The sizes a plan derives its sampling rate from (docs/privacy.md, "What is treated as public")."""

    n_users: int               # N, the number of train users (public)
    n_examples: int | None     # sum_u n_u; None with DP statistics (a statistic of the counts, never written)
    n_bounded: int | float     # N_G = sum_u min(n_u, G): exact, or N * mbar_G from the DP release
    mean_bounded: float        # mbar_G
    source: str                # "exact counts" or "DP histogram" (the plan's `planning_sizes`)


def planning_sizes(contributions: Contributions, n_users: int, group_size: int) -> PlanningSizes:
    """N, N_G and mbar_G of G from what the G rules read.

    Exact counts: the exact sizes (treated as public by default). The DP
    histogram: mbar_G is the histogram's estimate (`mean_bounded`, every user
    of bin k at 2^k, the value the SNR rule used for the same G) and
    N_G = N * mbar_G, so nothing but N and the release enters the plan.
    """
    if isinstance(contributions, ExactCounts):
        return PlanningSizes(contributions.n_users, int(contributions.counts.sum()),
                             contributions.n_bounded(group_size), contributions.mean_bounded(group_size),
                             "exact counts")
    mbar = float(contributions.mean_bounded(group_size))
    return PlanningSizes(int(n_users), None, float(n_users) * mbar, mbar, PRIVATE_SIZES)


def read_train_counts(users_path: str) -> np.ndarray:
    """Example counts of the train users from results/data/{dataset}/users.parquet."""
    from ..io import read_table

    try:
        table = read_table(users_path, columns=["user_id", "split", "n_examples"])
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
    n_users = contributions.get("n_users") or {}
    empty = [split for split in ("validation", "test") if int(n_users.get(split, 0) or 0) == 0]
    if empty:
        raise DataError(
            f"{where}: dataset {dataset!r} has no {' and no '.join(empty)} users (users per split: "
            f"{dict(n_users)}); the learning rate is chosen on validation users and results are reported on test "
            f"users. The split is a fraction of users (datasets.{dataset}.split.validation / .test), so a small "
            "dataset can get none: raise the fractions or use more users."
        )
