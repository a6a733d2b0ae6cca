"""Learning-rate selection on validation users, reported on test users.

Each grid cell is trained once per learning rate of `training.learning_rates`.
The rate with the lowest validation loss (token micro-average) is chosen and
its test metrics become the cell's result.

Privacy: validation users are disjoint from the training users, so choosing
the rate on them costs no privacy budget of the training data. Their data is
treated like test data (held out, not protected by the fine-tuning's DP
guarantee). This matches the study's protocol.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Mapping

from ..config import fmt_num
from ..errors import DataError
from ..io import atomic_path, read_json, write_json

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
    copy_atomic(ledger_paths[i], out_ledger)
    copy_atomic(train_log_paths[i], out_train_log)
    write_json(out_metrics, metrics)
    return metrics
