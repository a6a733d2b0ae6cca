"""Learning-rate selection on validation users, reported on test users.

Each grid cell is trained once per learning rate of `training.learning_rates`.
The rate with the lowest validation loss (token micro-average) is chosen and
its test metrics become the cell's result.

Privacy: validation users are disjoint from the training users and are
treated like test data (held out, not protected by the fine-tuning's DP
guarantee). Choosing among k rates is NOT free for the training data: the
choice is a function of k models trained on it. Each rate's run draws its own
Poisson samples and noise (training.run_seeds.run_seeds), so the k runs are
independent mechanisms, and the released model's guarantee is that of the
selection (`privacy.selection`, userdp.privacy.selection): their composition
(plus the DP contribution statistics release once, when there is one), or the
private-selection bound of random stopping. The cell's ledger is the chosen
run's with `epsilon` replaced by that released guarantee; the run's own is
kept as `epsilon_one_run`, with `learning_rates_tried` and `epsilon_meaning`.
By default each run was calibrated so that the released guarantee meets the
grid epsilon (docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Callable, Mapping

from ..errors import DataError
from ..io import read_frame, read_json, write_json
from ..training.model_card import write_card
from ..training.ledger import MECHANISM_FIELDS, guarantee_epsilon, run_event
from ..layout import RUN_MODEL, fmt_num
from ..privacy.selection import Selection
from .targets import METRIC_NAMES

log = logging.getLogger(__name__)

# Fields of eval.json copied to metrics.json (the artifact contract plus counts).
REPORTED = tuple(f"{split}_{name}" for split in ("test", "validation") for name in METRIC_NAMES)


def _as_float(x: object) -> float:
    """Metric value as a float; write_json stores non-finite floats as strings."""
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return v


#: metrics.json's `selection` of a cell with one learning rate whose validation users were not scored.
ONLY_RATE = "the only learning rate (nothing to choose; validation users not scored: evaluation.validation)"


def choose_learning_rate(validation_losses: Mapping[float, float]) -> float:
    """The rate with the lowest validation loss; ties go to the smaller rate.

    Diverged runs (NaN or infinite loss) never win unless every run diverged,
    in which case the smallest rate is returned (its metrics then show the
    divergence; the caller logs a warning).
    """
    if not validation_losses:
        raise ValueError("no learning rates to choose from")

    def key(lr: float) -> tuple[float, float]:
        v = _as_float(validation_losses[lr])
        return (v if math.isfinite(v) else math.inf, lr)

    return min(validation_losses, key=key)


def select(evals: Mapping[float, dict]) -> dict:
    """The cell's metrics.json content from each learning rate's eval.json content."""
    evals = {float(lr): ev for lr, ev in evals.items()}
    if len(evals) > 1:
        stale = [fmt_num(lr) for lr, ev in sorted(evals.items()) if "validation_loss" not in ev]
        if stale:
            raise DataError(f"eval.json of learning rate(s) {stale} has no validation_loss, which choosing among "
                            f"{len(evals)} rates needs (an evaluation from a one-rate config); rerun the cell's fine-tuning "
                            "job, which evaluates its runs (snakemake --forcerun finetune finetune_group; finished "
                            "runs are restored, not trained again).")
    losses = {lr: _as_float(ev.get("validation_loss")) for lr, ev in evals.items()}
    best = choose_learning_rate(losses)
    if any("validation_loss" in ev for ev in evals.values()) and not any(math.isfinite(v) for v in losses.values()):
        log.warning("every learning rate diverged (validation losses %s); reporting the smallest rate", losses)
    chosen = evals[best]
    # validation_loss is checked above where there is a choice; one rate may have skipped validation users
    if "test_loss" not in chosen:
        raise DataError(f"eval.json of learning rate {fmt_num(best)} lacks ['test_loss']; rerun the cell's "
                        "fine-tuning job, which evaluates its runs (snakemake --forcerun finetune finetune_group).")
    out = {k: chosen[k] for k in REPORTED if k in chosen}
    out["learning_rate"] = best
    out["selection"] = ("lowest validation_loss (token micro-average) on validation users" if len(evals) > 1
                        or "validation_loss" in chosen else ONLY_RATE)
    out["learning_rate_sweep"] = [
        {
            "learning_rate": lr,
            "validation_loss": ev.get("validation_loss"),
            "test_loss": ev.get("test_loss"),
        }
        for lr, ev in sorted(evals.items())
    ]
    if "evaluation" in chosen:
        out["evaluation"] = chosen["evaluation"]
    return out


def pretrained_metrics(evaluation: Mapping) -> dict:
    """The pretrained model's metrics.json: the same fields as a cell's, learning-rate fields null."""
    out = {k: evaluation[k] for k in REPORTED if k in evaluation}
    out.update(learning_rate=None, selection=None, learning_rate_sweep=None)
    return out | {k: evaluation[k] for k in ("evaluation", "model") if k in evaluation}


def copy_train_log(src: str | os.PathLike, dst: str | os.PathLike, debug_step_log: bool) -> None:
    """The released cell's train log: the run's, keeping only training.step_log.released_columns(debug_step_log).

    Without training.debug_step_log the per-step noise-free columns (batch loss, realised sizes, timing) never
    reach the cell, also from a run trained while the option was on.
    """

    from ..io import write_parquet
    from ..training.step_log import released_columns

    if not Path(src).exists():
        raise DataError(f"{src} does not exist; the training rule should have written it.")
    frame = read_frame(src)
    write_parquet(dst, frame[[c for c in released_columns(debug_step_log, adaptive=True) if c in frame.columns]])


def copy_user_scores(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """The released run's per-user test scores (eval_users.parquet) as the cell's users.parquet."""
    from ..io import write_parquet

    if not Path(src).exists():
        raise DataError(f"{src} does not exist; the run's fine-tuning job should have written it when it evaluated "
                        "the run (rerun it: snakemake --forcerun finetune finetune_group).")
    write_parquet(dst, read_frame(src))


def with_selection_epsilon(chosen: dict, ledgers: list[dict], paths: list[str],
                           accountant: Callable[..., float] | None = None) -> dict:
    """The chosen run's ledger, its `epsilon` the released model's: the selection among all `ledgers`.

    All runs of a cell must share the mechanism (same plan); a mismatch means
    the runs come from different plans and is an error, as is a number of
    runs other than the plan calibrated for. The DP contribution statistics
    release, when there is one, is composed once.
    """
    for led, path in zip(ledgers, paths):
        diff = [k for k in MECHANISM_FIELDS if led.get(k) != chosen.get(k)]
        if diff:
            raise DataError(
                f"{path}: the learning-rate runs of this cell ran different mechanisms ({', '.join(diff)} differ "
                "from the chosen run's); delete the cell's lr~* folders and rerun."
            )
    k = len(ledgers)
    selection = Selection.from_record(chosen.get("selection"))
    if selection.mode == "composed" and selection.candidates != k:
        raise DataError(
            f"{paths[0]}: the plan calibrated each run for a released model chosen among {selection.candidates} "
            f"learning-rate runs, but {k} ran; rerun the cell's plan (training.learning_rates changed?)."
        )
    if selection.mode == "per_run":
        selection = dataclasses.replace(selection, candidates=k)
    out = dict(chosen)
    out["epsilon_one_run"] = chosen.get("epsilon")
    out["learning_rates_tried"] = k
    out["selection"] = selection.record() | ({"candidates": k} if selection.mode == "per_run" else {})
    if k == 1 and selection.mode != "random_stopping":
        out["epsilon"] = chosen.get("epsilon")  # one run is the whole selection
    else:
        out["epsilon"] = guarantee_epsilon([run_event(led) for led in ledgers], chosen.get("delta"),
                                           chosen.get("contribution_stats"), accountant, selection=selection)
    out["epsilon_meaning"] = selection.meaning()
    log.info("released model's epsilon %.4g (%s); one run's %s", float(out["epsilon"]), out["epsilon_meaning"],
             chosen.get("epsilon"))
    return out


def select_cell(
    learning_rates: list[float],
    eval_paths: list[str],
    ledger_paths: list[str],
    train_log_paths: list[str],
    out_metrics: str,
    out_ledger: str,
    out_train_log: str,
    debug_step_log: bool = False,
    user_paths: list[str] | None = None,
    out_users: str | None = None,
) -> dict:
    """Pick the cell's learning rate, write metrics.json, copy the chosen ledger and train log (and, with
    `user_paths` and `out_users`, the chosen run's per-user test scores).

    The lists are aligned: entry i belongs to `learning_rates[i]`. The train
    log is copied with the columns `training.debug_step_log` allows
    (`copy_train_log`).
    """
    if not (len(learning_rates) == len(eval_paths) == len(ledger_paths) == len(train_log_paths)):
        raise ValueError("learning_rates, eval, ledger and train-log paths must be aligned lists")
    if (user_paths is None) != (out_users is None) or (user_paths is not None and len(user_paths) != len(eval_paths)):
        raise ValueError("user_paths (one per learning rate) and out_users go together")
    evals = {float(lr): read_json(p) for lr, p in zip(learning_rates, eval_paths)}
    metrics = select(evals)
    i = [float(lr) for lr in learning_rates].index(metrics["learning_rate"])
    log.info("chose learning rate %s (validation losses %s)", fmt_num(metrics["learning_rate"]),
             {fmt_num(k): v.get("validation_loss") for k, v in evals.items()})
    ledgers = [read_json(p) for p in ledger_paths]
    ledger = with_selection_epsilon(ledgers[i], ledgers, ledger_paths)  # every input read before any output
    copy_train_log(train_log_paths[i], out_train_log, debug_step_log)
    if user_paths is not None:
        copy_user_scores(user_paths[i], out_users)
    write_json(out_ledger, ledger)
    cell, chosen = Path(out_ledger).parent, Path(ledger_paths[i]).parent
    where = os.path.relpath(chosen / RUN_MODEL, cell)
    write_card(cell, ledger, title=f"User-level DP fine-tuned model: the cell's released run ({where}/, learning "
               f"rate {fmt_num(metrics['learning_rate'])})")
    write_json(out_metrics, metrics)
    return metrics
