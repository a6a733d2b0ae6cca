"""Learning-rate selection on validation users, reported on test users.

Each grid cell is trained once per learning rate of `training.learning_rates`.
The rate with the lowest validation loss (token micro-average) is chosen and
its test metrics become the cell's result.

Privacy: validation users are disjoint from the training users and are
treated like test data (held out, not protected by the fine-tuning's DP
guarantee). Choosing among k rates is NOT free for the training data: the
choice is a function of k models trained on it. Each rate's run draws its own
Poisson samples and noise (training.engine.run_seeds), so the k runs are
independent mechanisms, and the released model's guarantee is bounded by
their composition: k * T steps of the same mechanism (plus the DP
contribution statistics release once, when there is one). The cell's ledger
keeps `epsilon` (one run, as the study reports it) and adds
`learning_rates_tried` and `epsilon_including_lr_selection` (the composition).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Mapping

from ..errors import DataError
from ..io import atomic_path, read_json, write_json
from ..training.ledger import MECHANISM_FIELDS, guarantee_epsilon, run_event
from ..layout import fmt_num

log = logging.getLogger(__name__)

# Fields of eval.json copied to metrics.json (the artifact contract plus counts).
REPORTED = (
    "test_loss",
    "test_loss_user_macro",
    "test_perplexity",
    "test_accuracy",
    "test_n_tokens",
    "test_n_examples",
    "test_n_users",
    "validation_loss",
    "validation_loss_user_macro",
    "validation_perplexity",
    "validation_accuracy",
    "validation_n_tokens",
    "validation_n_examples",
    "validation_n_users",
)


def _as_float(x: object) -> float:
    """Metric value as a float; write_json stores non-finite floats as strings."""
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return v


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
    losses = {lr: _as_float(ev.get("validation_loss")) for lr, ev in evals.items()}
    best = choose_learning_rate(losses)
    if not any(math.isfinite(v) for v in losses.values()):
        log.warning("every learning rate diverged (validation losses %s); reporting the smallest rate", losses)
    chosen = evals[best]
    missing = [k for k in ("validation_loss", "test_loss") if k not in chosen]
    if missing:
        raise DataError(f"eval.json of learning rate {fmt_num(best)} lacks {missing}; rerun the evaluate rule.")
    out = {k: chosen[k] for k in REPORTED if k in chosen}
    out["learning_rate"] = best
    out["selection"] = "lowest validation_loss (token micro-average) on validation users"
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
    out["learning_rate"] = None
    out["selection"] = None
    out["learning_rate_sweep"] = None
    for k in ("evaluation", "model"):
        if k in evaluation:
            out[k] = evaluation[k]
    return out


def copy_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a file so that `dst` appears only when complete."""
    if not Path(src).exists():
        raise DataError(f"{src} does not exist; the training rule should have written it.")
    with atomic_path(dst, suffix=Path(dst).suffix) as tmp:
        shutil.copyfile(src, tmp)


def with_selection_epsilon(chosen: dict, ledgers: list[dict], paths: list[str],
                           accountant: Callable[..., float] | None = None) -> dict:
    """The chosen run's ledger plus the epsilon of choosing among all `ledgers`: their events composed.

    All runs of a cell must share the mechanism (same plan); a mismatch means
    the runs come from different plans and is an error. The DP contribution
    statistics release, when there is one, is composed once.
    """
    for led, path in zip(ledgers, paths):
        diff = [k for k in MECHANISM_FIELDS if led.get(k) != chosen.get(k)]
        if diff:
            raise DataError(
                f"{path}: the learning-rate runs of this cell ran different mechanisms ({', '.join(diff)} differ "
                "from the chosen run's); delete the cell's lr~* folders and rerun."
            )
    k = len(ledgers)
    out = dict(chosen)
    out["learning_rates_tried"] = k
    if k == 1:
        out["epsilon_including_lr_selection"] = chosen.get("epsilon")
    else:
        out["epsilon_including_lr_selection"] = guarantee_epsilon(
            [run_event(led) for led in ledgers], chosen.get("delta"), chosen.get("contribution_stats"), accountant)
    log.info("epsilon of one run %s; of choosing among %d learning rates (composed) %.4g",
             chosen.get("epsilon"), k, float(out["epsilon_including_lr_selection"]))
    return out


def select_cell(
    learning_rates: list[float],
    eval_paths: list[str],
    ledger_paths: list[str],
    train_log_paths: list[str],
    out_metrics: str,
    out_ledger: str,
    out_train_log: str,
) -> dict:
    """Pick the cell's learning rate, write metrics.json, copy the chosen ledger and train log.

    The lists are aligned: entry i belongs to `learning_rates[i]`.
    """
    if not (len(learning_rates) == len(eval_paths) == len(ledger_paths) == len(train_log_paths)):
        raise ValueError("learning_rates, eval, ledger and train-log paths must be aligned lists")
    evals = {float(lr): read_json(p) for lr, p in zip(learning_rates, eval_paths)}
    metrics = select(evals)
    i = [float(lr) for lr in learning_rates].index(metrics["learning_rate"])
    log.info("chose learning rate %s (validation losses %s)", fmt_num(metrics["learning_rate"]),
             {fmt_num(k): v.get("validation_loss") for k, v in evals.items()})
    ledgers = [read_json(p) for p in ledger_paths]
    write_json(out_ledger, with_selection_epsilon(ledgers[i], ledgers, ledger_paths))
    copy_atomic(train_log_paths[i], out_train_log)
    write_json(out_metrics, metrics)
    return metrics
