"""The synthetic mean-estimation study (docs/method.md section 9).

DP-SGD-ELS and DP-SGD-ULS estimate the population mean of synthetic users
(mean_estimation_population) under the same compute budget K and the same
user-level (epsilon, delta), with the same sampling, clipping, accounting
and calibration rules as the language-model runs (docs/method.md sections 2-6). The metric
is ||theta_T - mu||^2.

Two stages, so that the expensive privacy calibration is not redone when
only the simulation or a plot changes:
1. `plan_calibrations` + `calibrate_cells`: every distinct (method, epsilon,
   delta, q, T, G) is calibrated once (the contribution counts, hence the
   sampling rates, do not depend on the replicate seed).
2. `run_study`: every (seed, diversity, G, method, budget, epsilon) cell runs
   all learning rates at once; the learning rate of each (method, epsilon,
   budget, diversity, G), and the best G of ULS, are chosen on separate
   tuning seeds and the errors are reported on the report seeds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from ..errors import ConfigError
from ..layout import fmt_num
from ..privacy.contributions import ExactCounts
from ..privacy.mechanism import METHODS as MECHANISMS
from ..seeding import derive_seed
from ..workers import process_pool
from .mean_estimation_population import Population, contribution_counts
from .mean_estimation_sgd import run_els, run_uls

log = logging.getLogger("userdp.mean_estimation")

METHODS = ("els", "uls")
# How each method's G is chosen for the comparisons across epsilon, budget and
# diversity: the study's heuristic for ELS, the best G of the sweep for ULS.
GROUP_SIZE_RULES = {"els": "median", "uls": "best_of_sweep"}

CalibrateFn = Callable[..., Any]


@dataclass(frozen=True)
class MeanEstimationSpec:
    """The mean_estimation.* config section, plus the root seed and delta."""

    dimension: int
    n_users: int
    contributions_median: float
    contributions_sigma: float
    inter_user_spread: float
    diversities: tuple[float, ...]
    epsilons: tuple[float, ...]
    budgets: tuple[tuple[int, int], ...]  # (compute K, steps T)
    group_sizes: tuple[int, ...]
    clip_norm: float
    learning_rates: tuple[float, ...]
    seeds: tuple[int, ...]
    tuning_seeds: tuple[int, ...]
    delta: float
    root_seed: int = 0
    group_sweep_epsilon: float | None = None

    @classmethod
    def from_config(cls, config: dict) -> "MeanEstimationSpec":
        """Build from a validated config (defaults filled in by userdp.config)."""
        me = config.get("mean_estimation") or {}
        try:
            n_users = int(me["n_users"])
            delta = me.get("delta")
            if delta is None:
                exponent = float((config.get("privacy") or {}).get("delta_exponent", 1.1))
                delta = 1.0 / n_users**exponent
            spec = cls(
                dimension=int(me["dimension"]),
                n_users=n_users,
                contributions_median=float(me["contributions_median"]),
                contributions_sigma=float(me["contributions_sigma"]),
                inter_user_spread=float(me["inter_user_spread"]),
                diversities=tuple(float(s) for s in me["diversities"]),
                epsilons=tuple(float(e) for e in me["epsilons"]),
                budgets=tuple((int(b["compute"]), int(b["steps"])) for b in me["budgets"]),
                group_sizes=tuple(sorted({int(g) for g in me["group_sizes"]})),
                clip_norm=float(me["clip_norm"]),
                learning_rates=tuple(float(x) for x in me["learning_rates"]),
                seeds=tuple(int(s) for s in me["seeds"]),
                tuning_seeds=tuple(int(s) for s in me.get("tuning_seeds", [])),
                delta=float(delta),
                root_seed=int(config.get("seed", 0)),
                group_sweep_epsilon=(None if me.get("group_sweep_epsilon") is None
                                     else float(me["group_sweep_epsilon"])),
            )
        except KeyError as exc:
            raise ConfigError(
                f"config key mean_estimation.{exc.args[0]} is missing; validate the config "
                "(userdp.config.validate_config) so that defaults are filled in."
            ) from None
        for key in ("diversities", "epsilons", "budgets", "group_sizes", "learning_rates", "seeds"):
            if not getattr(spec, key):
                raise ConfigError(f"config key mean_estimation.{key} is empty; give at least one value.")
        if spec.group_sweep_epsilon is not None and spec.group_sweep_epsilon not in spec.epsilons:
            raise ConfigError(
                f"config key mean_estimation.group_sweep_epsilon is {spec.group_sweep_epsilon:g}, which is not "
                f"one of mean_estimation.epsilons {list(spec.epsilons)}; pick one of them or null (the middle one)."
            )
        return spec

    @property
    def sweep_epsilon(self) -> float:
        """The epsilon at which ELS runs the whole G sweep (default: the middle epsilon)."""
        if self.group_sweep_epsilon is not None:
            return self.group_sweep_epsilon
        eps = sorted(self.epsilons)
        return eps[len(eps) // 2]

    def epsilons_for(self, method: str, group_size: int, counts: np.ndarray) -> tuple[float, ...]:
        """Epsilons a (method, G) runs at.

        ULS needs every G at every epsilon (its best G is chosen per cell).
        ELS uses G = median everywhere; its other G values only feed the
        G-sweep figure, so they run at one epsilon: the ELS calibrations
        (mixture-of-Gaussians accountant) are the slowest part of the study.
        """
        if method == "uls" or group_size == ExactCounts(counts).median_group_size():
            return self.epsilons
        return (self.sweep_epsilon,)

    def counts(self) -> np.ndarray:
        """Examples per user (fixed by the config seed: the dataset's public shape)."""
        return contribution_counts(self.n_users, self.contributions_median, self.contributions_sigma, self.root_seed)

    def method_group_sizes(self, counts: np.ndarray) -> dict[str, tuple[int, ...]]:
        """G values each method runs: the sweep, plus the median for ELS."""
        els = tuple(sorted(set(self.group_sizes) | {ExactCounts(counts).median_group_size()}))
        return {"els": els, "uls": self.group_sizes}


# ---------------------------------------------------------------- calibration


def plan_calibrations(spec: MeanEstimationSpec, counts: np.ndarray | None = None) -> pd.DataFrame:
    """One row per (method, epsilon, budget, G): the sampling rate and expected batch.

    ELS: B = K / T examples, q = B / N_G. ULS: M = K / (T * mbar_G) users,
    q_u = M / N (docs/method.md section 5).
    """
    counts = spec.counts() if counts is None else counts
    n = len(counts)
    rows = []
    for method, gs in spec.method_group_sizes(counts).items():
        for g in gs:
            kept = np.minimum(counts, g)
            pool_size, mean_kept = int(kept.sum()), float(kept.mean())
            for compute, steps in spec.budgets:
                epsilons = spec.epsilons_for(method, g, counts)
                s = MECHANISMS[method].sampling_for_budget(compute, steps, n, pool_size, mean_kept)
                expected, rate = s.expected_batch, s.sampling_rate
                if rate > 1:
                    raise ConfigError(
                        f"mean_estimation.budgets: compute {compute} with {steps} steps needs an expected "
                        f"{method.upper()} batch of {expected:.1f} {s.unit} per step at G={g}, more than the "
                        f"{s.population} available; use more steps or a smaller compute budget."
                    )
                for eps in epsilons:
                    rows.append(dict(
                        method=method, epsilon=eps, delta=spec.delta, compute_budget=compute, steps=steps,
                        group_size=g, sampling_rate=rate, expected_batch=expected,
                        pool_size=pool_size, mean_contributions=mean_kept,
                    ))
    return pd.DataFrame(rows)


def _calibration_key(row: dict) -> tuple:
    # ULS accounting does not depend on G (one user, one clipped gradient).
    mech = MECHANISMS[row["method"]](float(row["sampling_rate"]), int(row["steps"]), int(row["group_size"]))
    g = mech.accounting_group_size
    return (row["method"], float(row["epsilon"]), float(row["delta"]), float(row["sampling_rate"]),
            int(row["steps"]), g)


def _real_calibrate(method: str, epsilon: float, delta: float, sampling_rate: float, steps: int,
                    group_size: int) -> tuple[float, float, str | None]:
    """Calibrate with the project's accountant (imported lazily: it is heavy)."""
    from userdp.privacy.calibration import calibrate

    cell = f"mean_estimation {method} eps={fmt_num(epsilon)} q={sampling_rate:.6g} T={steps} G={group_size}"
    res = calibrate(MECHANISMS[method](sampling_rate, steps, group_size), epsilon, delta, cell=cell)
    return float(res.noise_multiplier), float(res.epsilon_achieved), getattr(res, "accountant", None)


def calibrate_cells(
    plan: pd.DataFrame,
    calibrate_fn: CalibrateFn | None = None,
    workers: int = 1,
) -> pd.DataFrame:
    """Add noise_multiplier / epsilon_achieved / accountant to the plan.

    Each distinct (method, epsilon, delta, q, T, G) is calibrated once.
    `calibrate_fn(method, epsilon, delta, sampling_rate, steps, group_size=...)`
    returns an object with .noise_multiplier and .epsilon_achieved; None uses
    userdp.privacy.calibration.calibrate, in `workers` processes.
    """
    records = plan.to_dict("records")
    keys = sorted({_calibration_key(r) for r in records})
    start = time.monotonic()
    if calibrate_fn is None:
        if workers > 1 and len(keys) > 1:
            with process_pool(workers) as pool:
                values = list(pool.map(_real_calibrate, *zip(*keys)))
        else:
            values = [_real_calibrate(*k) for k in keys]
    else:
        values = []
        for k in keys:
            res = calibrate_fn(*k[:5], group_size=k[5])
            values.append((float(res.noise_multiplier), float(res.epsilon_achieved),
                           getattr(res, "accountant", None)))
    log.info("calibrated %d distinct cells (of %d rows) in %.1fs", len(keys), len(records),
             time.monotonic() - start)
    table = dict(zip(keys, values))
    out = plan.copy()
    cal = [table[_calibration_key(r)] for r in records]
    out["noise_multiplier"] = [c[0] for c in cal]
    out["epsilon_achieved"] = [c[1] for c in cal]
    out["accountant"] = [c[2] if c[2] is not None else MECHANISMS[r["method"]].accountant
                         for c, r in zip(cal, records)]
    return out


# ---------------------------------------------------------------- simulation


def _check_calibration(spec: MeanEstimationSpec, counts: np.ndarray, calibration: pd.DataFrame) -> pd.DataFrame:
    """Index the calibration table by cell; fail if it does not match this spec."""
    plan = plan_calibrations(spec, counts)
    idx = ["method", "epsilon", "compute_budget", "group_size"]
    cal = calibration.set_index(idx)
    missing = [k for k in plan.set_index(idx).index if k not in cal.index]
    if missing:
        raise ConfigError(
            f"the mean-estimation calibration table lacks {len(missing)} cell(s), e.g. {missing[0]}; "
            "it was made for another config: rerun the calibration rule."
        )
    joined = plan.set_index(idx).join(cal[["sampling_rate", "steps", "delta"]].add_suffix("_cal"))
    if not (np.allclose(joined["sampling_rate"], joined["sampling_rate_cal"], rtol=1e-9)
            and (joined["steps"] == joined["steps_cal"]).all()
            and np.allclose(joined["delta"], joined["delta_cal"], rtol=1e-9)):
        raise ConfigError(
            "the mean-estimation calibration table's sampling rates, steps or delta differ from the "
            "config's (mean_estimation.n_users/contributions_*/budgets or seed changed): rerun the calibration."
        )
    return cal


def _select(sweep: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Pick the learning rate per (method, eps, budget, s, G) and ULS's best G.

    Choices use the tuning replicates when there are any, else the report
    replicates themselves (an optimistic, oracle choice; documented).
    """
    tuning = sweep[sweep["phase"] == "tuning"]
    basis = tuning if len(tuning) else sweep[sweep["phase"] == "report"]
    cell = ["method", "epsilon", "compute_budget", "diversity", "group_size"]
    mean_err = basis.groupby(cell + ["learning_rate"], as_index=False)["squared_error"].mean()
    mean_err = mean_err.sort_values(cell + ["squared_error", "learning_rate"])
    best_lr = mean_err.groupby(cell, as_index=False).first().rename(
        columns={"squared_error": "tuning_squared_error"})
    return best_lr, mean_err


def run_study(
    spec: MeanEstimationSpec,
    calibration: pd.DataFrame,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run every cell; return (results, learning-rate sweep).

    results: one row per (method, epsilon, budget, diversity, G, seed) on the
    report seeds at the chosen learning rate, with the calibration, the
    choice flags (`chosen`: the G this method uses in the comparisons) and
    the realised compute ratio. sweep: every (phase, seed, cell, lr) error.
    """
    counts = spec.counts()
    cal = _check_calibration(spec, counts, calibration)
    gsets = spec.method_group_sizes(counts)
    all_g = sorted(set(gsets["els"]) | set(gsets["uls"]))
    lrs = np.asarray(spec.learning_rates)
    phases = [("tuning", s) for s in spec.tuning_seeds] + [("report", s) for s in spec.seeds]
    total = len(phases) * len(spec.diversities) * sum(len(v) for v in gsets.values()) * len(spec.budgets)
    done = 0
    rows: list[dict] = []
    for phase, seed in phases:
        pop = Population(counts, spec.dimension, spec.inter_user_spread, max(all_g), seed=seed,
                         root_seed=spec.root_seed, phase=phase)
        for s in spec.diversities:
            for g in all_g:
                pool = pop.bounded(s, g)
                for method in METHODS:
                    if g not in gsets[method]:
                        continue
                    runner = run_els if method == "els" else run_uls
                    for compute, steps in spec.budgets:
                        # All epsilons of a (method, budget, G) share q, T and
                        # expected batch: one vectorised run covers them.
                        epsilons = spec.epsilons_for(method, g, counts)
                        cells = [cal.loc[(method, eps, compute, g)] for eps in epsilons]
                        cell = (spec.root_seed, "mean_estimation", "train", phase, seed, method, f"budget={compute}",
                                f"s={fmt_num(s)}", f"G={g}")
                        rng_sample, rng_noise = (np.random.default_rng(derive_seed(*cell, what))
                                                 for what in ("sample", "noise"))
                        res = runner(
                            pool, sampling_rate=float(cells[0]["sampling_rate"]),
                            noise_multipliers=[float(c["noise_multiplier"]) for c in cells],
                            clip_norm=spec.clip_norm, expected_batch=float(cells[0]["expected_batch"]),
                            steps=steps, learning_rates=lrs, rng_sample=rng_sample, rng_noise=rng_noise,
                        )
                        errors = ((res.theta - pop.mu) ** 2).sum(axis=-1)  # (eps, lr)
                        for i, eps in enumerate(epsilons):
                            for lr, err in zip(lrs, errors[i]):
                                rows.append(dict(
                                    phase=phase, seed=seed, method=method, epsilon=eps, compute_budget=compute,
                                    steps=steps, diversity=s, group_size=g, learning_rate=float(lr),
                                    squared_error=float(err),
                                    realised_compute_ratio=res.realised_compute / compute,
                                    mean_realised_batch=float(res.batch_sizes.mean()),
                                ))
                        done += 1
                        if progress is not None:
                            progress(done, total)
    sweep = pd.DataFrame(rows)
    best_lr, _ = _select(sweep)
    cell = ["method", "epsilon", "compute_budget", "diversity", "group_size"]
    report = sweep[sweep["phase"] == "report"].merge(best_lr[cell + ["learning_rate", "tuning_squared_error"]],
                                                     on=cell + ["learning_rate"], how="inner")
    # The G each method uses in the comparisons across epsilon, budget and diversity.
    med = ExactCounts(counts).median_group_size()
    uls_best = (best_lr[best_lr["method"] == "uls"].sort_values(["tuning_squared_error", "group_size"])
                .groupby(["epsilon", "compute_budget", "diversity"], as_index=False).first())
    chosen_keys = {("els", r.epsilon, r.compute_budget, r.diversity, med)
                   for r in best_lr[best_lr["method"] == "els"].itertuples()}
    chosen_keys |= {("uls", r.epsilon, r.compute_budget, r.diversity, r.group_size) for r in uls_best.itertuples()}
    report["chosen"] = [k in chosen_keys for k in zip(report["method"], report["epsilon"], report["compute_budget"],
                                                       report["diversity"], report["group_size"])]
    report["group_size_rule"] = np.where(report["chosen"], report["method"].map(GROUP_SIZE_RULES), "sweep")
    cal_cols = ["sampling_rate", "expected_batch", "noise_multiplier", "epsilon_achieved", "delta",
                "pool_size", "mean_contributions", "accountant"]
    report = report.merge(calibration[["method", "epsilon", "compute_budget", "group_size"] + cal_cols],
                          on=["method", "epsilon", "compute_budget", "group_size"], how="left")
    report = report.assign(
        clip_norm=spec.clip_norm, dimension=spec.dimension, n_users=spec.n_users,
        inter_user_spread=spec.inter_user_spread, median_contributions=med,
        lr_selection="tuning_seeds" if spec.tuning_seeds else "report_seeds",
    ).drop(columns=["phase"])
    order = ["method", "epsilon", "compute_budget", "steps", "diversity", "group_size", "seed", "squared_error",
             "chosen", "group_size_rule", "learning_rate", "tuning_squared_error"]
    report = report[order + [c for c in report.columns if c not in order]]
    report = report.sort_values(["method", "epsilon", "compute_budget", "diversity", "group_size", "seed"])
    return report.reset_index(drop=True), sweep


def uls_over_els(results: pd.DataFrame) -> pd.DataFrame:
    """Ratio of mean errors ULS / ELS (chosen G each) per (eps, budget, s): < 1 means ULS wins."""
    s = results[results["chosen"]].pivot_table(index=["epsilon", "compute_budget", "diversity"], columns="method",
                                               values="squared_error")
    s["uls_over_els"] = s["uls"] / s["els"]
    return s.reset_index()


__all__ = [
    "MeanEstimationSpec", "plan_calibrations", "calibrate_cells", "run_study", "uls_over_els",
]
