"""Private selection by random stopping: one job trains a random number of runs and releases the best.

`privacy.selection.accounting: random_stopping` (Papernot & Steinke 2022,
"Hyperparameter Tuning with Renyi Differential Privacy"): the number of runs
K is drawn from a truncated negative binomial (`Selection.draw_runs`, with
dp-accounting's own gamma for the mean and shape), each run draws its
learning rate uniformly from `training.learning_rates` and trains with its
own samples and noise (its index is part of its seeds), and the run with the
lowest validation loss is released. The analysis bounds the RELEASED model
only, "outputs of other runs are not returned": K, the other runs and their
scores are part of the mechanism's secret. So one job (rule
`random_stopping`) does the whole selection:

* K and the K learning rates are drawn once, from OS entropy under secret
  seeds (`privacy.secret_seeds`) or from seeds derived from the config, and
  kept in a state file (0600, in a 0700 folder `.random_stopping/` of the
  cell) so that a killed job resumes the same draw; each run trains into
  `.random_stopping/trial~{i}/` (resuming its own checkpoint) and is scored
  on validation users right away, and only the best run so far is kept.
* At the end the best run's model goes to the cell's `model/`, its ledger
  (epsilon: the random-stopping bound, `selection.Selection.epsilon`) and
  train log to the cell folder, its metrics to `metrics.json`, and the state
  folder is deleted (an error if it cannot be).
* With derived seeds (no guarantee against whoever holds the config anyway)
  the ledger and metrics also record K, the chosen run's index and every
  run's learning rate and validation loss, for research; with secret seeds
  they record none of these. The job's log and wall time reveal K: they are
  outside the guarantee, like the debug step log (docs/privacy.md).

Validation users are disjoint from training users (like test data), as in
the learning-rate sweep of the other modes (evaluation.select).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .. import grid, layout
from ..errors import DataError
from ..io import atomic_path, json_text, read_json, write_json
from ..layout import fmt_num
from ..privacy import seed_secrecy
from ..privacy.selection import Selection
from ..privacy.spec import RunSpec
from ..seeding import derive_seed
from ..training import checkpoint
from ..training.targets import FINETUNE_UNTRACKED_KEYS
from .select import REPORTED, choose_learning_rate, copy_train_log, copy_user_scores, with_selection_epsilon

log = logging.getLogger(__name__)

STATE_DIR = ".random_stopping"  # in the cell folder: the draw and the runs in progress (deleted at the end)
STATE_FILE = "state.json"
SELECTION_TEXT = ("random stopping (Papernot-Steinke): the lowest validation_loss (token micro-average) on "
                  "validation users among a random number of runs")


@dataclass
class RandomStoppingJob:
    """What the `random_stopping` rule's job needs; `finetune` builds each run's FinetuneJob from it."""

    config: dict[str, Any]
    plan: str
    tokens: str
    tokenizer: str
    model: str
    cell_dir: str
    dataset: str
    method: str
    eps: str
    budget: str
    seed: int
    group: int = 0
    option: str | None = None  # the grid.options entry of the cell (part of its runs' seeds and of the draw's)
    threads: int = 1
    processes: int = 0
    log: str | None = None


def draw(selection: Selection, candidates: list[float], secret: bool, seed: int) -> dict[str, Any]:
    """The number of runs K and each run's learning rate: OS entropy when `secret`, else from `seed`."""
    if secret:
        rng = secrets.SystemRandom()
        uniform, pick = rng.random, lambda: rng.randrange(len(candidates))
    else:
        gen = np.random.Generator(np.random.PCG64(seed))
        uniform, pick = (lambda: float(gen.random())), (lambda: int(gen.integers(len(candidates))))
    k = selection.draw_runs(uniform())
    return {"runs": k, "learning_rates": [float(candidates[pick()]) for _ in range(k)], "done": []}


def _write_state(path: Path, state: dict[str, Any]) -> None:
    with atomic_path(path, mode=checkpoint.FILE_MODE) as tmp:
        tmp.write_text(json_text(state), encoding="utf-8")


def _link_or_copy_tree(src: Path, dst: Path) -> None:
    """dst (new) with src's files: hard links when the filesystem allows, else copies."""
    tmp = dst.parent / f".{dst.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        shutil.copytree(src, tmp, copy_function=os.link)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def _train(job: RandomStoppingJob, trial: int, learning_rate: float, run_dir: Path) -> None:
    from ..training import finetune_job

    finetune_job.launch(finetune_job.FinetuneJob(
        config=job.config, plan=job.plan, tokens=job.tokens, tokenizer=job.tokenizer, model=job.model,
        run_dir=str(run_dir), learning_rate=learning_rate, dataset=job.dataset, method=job.method, eps=job.eps,
        budget=job.budget, seed=int(job.seed), threads=int(job.threads), log=job.log, trial=trial,
        option=job.option,
    ), processes=int(job.processes))


def _evaluate(job: RandomStoppingJob, model_dir: Path) -> dict[str, Any]:
    from .metrics import evaluate_models

    ev = job.config["evaluation"]
    # each test user's scores next to the run's eval.json (the released run's become the cell's users.parquet)
    return evaluate_models([model_dir], job.tokens, dataset=job.dataset, root_seed=int(job.config["seed"]),
                           max_users=ev["max_users"], batch_size=int(ev["batch_size"]),
                           device=job.config["training"]["device"], local_model=True,
                           users_out=[Path(model_dir).parent / layout.EVAL_USERS])[0]


def run_cell(job: RandomStoppingJob, *, out_metrics: str, out_ledger: str, out_train_log: str, out_model: str,
             train: Callable[..., None] = _train, evaluate: Callable[..., dict] = _evaluate,
             out_users: str | None = None) -> dict[str, Any]:
    """Draw (or resume) the runs, train and score them, release the best; returns the cell's metrics.

    train(job, trial, learning_rate, run_dir) and evaluate(job, model_dir) are a fine-tuning run and its
    evaluation as rule finetune runs them (tests inject stand-ins).
    """
    from ..training.run_state import RunPaths

    selection = RunSpec.load(job.plan).selection_policy
    if selection.mode != "random_stopping":
        raise DataError(f"{job.plan}: the plan was calibrated for privacy.selection.accounting "
                        f"{selection.mode!r}, not random_stopping; rerun the plan rule (delete the plan).")
    candidates = [float(lr) for lr in job.config["training"]["learning_rates"]]
    if selection.candidates != len(candidates):
        raise DataError(f"{job.plan}: the plan is for {selection.candidates} candidate learning rates, "
                        f"training.learning_rates has {len(candidates)}; rerun the plan rule.")
    secret = seed_secrecy.secret_seeds(job.config, job.dataset)
    work = Path(job.cell_dir) / STATE_DIR
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, checkpoint.DIR_MODE)
    state_path = work / STATE_FILE
    if state_path.exists():
        state = read_json(state_path)
        if state.get("candidates") != candidates or state.get("selection") != selection.record():
            raise DataError(f"{state_path} belongs to another selection (learning rates or privacy.selection "
                            f"changed); delete {work} to start the cell's selection afresh.")
        log.info("resuming the selection after %d finished run(s)", len(state["done"]))
    else:
        seed = derive_seed(int(job.config["seed"]), job.dataset, job.method, job.eps, int(job.budget),
                           int(job.group), int(job.seed), "random_stopping", *(("option", job.option)
                                                                                if job.option else ()))
        state = draw(selection, candidates, secret, seed) | {"candidates": candidates,
                                                             "selection": selection.record(), "secret": secret}
        _write_state(state_path, state)
    k = int(state["runs"])
    log.info("random stopping: %s runs (mean %g, shape %g) over learning rates %s",
             "a secret number of" if secret else k, selection.mean_runs, selection.shape,
             [fmt_num(x) for x in candidates])

    def best_of(done: list[dict]) -> int:  # lowest validation loss; ties and non-finite losses as evaluation.select
        losses = {i: d["validation_loss"] for i, d in enumerate(done)}
        return choose_learning_rate(losses)

    for trial in range(len(state["done"]), k):
        lr = float(state["learning_rates"][trial])
        run_dir = work / f"trial~{trial}"
        log.info("run %d%s: learning rate %s", trial + 1, "" if secret else f" of {k}", fmt_num(lr))
        paths = RunPaths(run_dir)
        if not (paths.ledger.exists() and not paths.checkpoint_dir.exists()):
            train(job, trial, lr, run_dir)  # resumes the run's own checkpoint; a complete run is not retrained
        ev = evaluate(job, run_dir / layout.RUN_MODEL)
        ev["learning_rate"] = lr
        write_json(run_dir / layout.EVAL, ev)
        state["done"].append({"learning_rate": lr, "validation_loss": ev.get("validation_loss"),
                              "test_loss": ev.get("test_loss")})
        best = best_of(state["done"])
        for i in range(len(state["done"])):  # keep only the best run so far
            other = work / f"trial~{i}"
            if i != best and other.exists():
                shutil.rmtree(other)
        _write_state(state_path, state)

    best = best_of(state["done"])
    best_dir = work / f"trial~{best}"
    chosen_eval = read_json(best_dir / layout.EVAL)
    chosen = read_json(best_dir / layout.LEDGER)
    ledger = with_selection_epsilon(chosen, [chosen], [str(best_dir / layout.LEDGER)])
    ledger["learning_rates_tried"] = len(candidates)  # the candidate set; how many runs ran is the secret K
    metrics = {k_: chosen_eval[k_] for k_ in REPORTED if k_ in chosen_eval}
    metrics["learning_rate"] = float(state["learning_rates"][best])
    metrics["selection"] = SELECTION_TEXT
    if secret:
        ledger["random_stopping"] = {"runs": "secret", "chosen_run": "secret"}
        # the torch seed (dropout, not the DP noise) is derived from the run's index: it would tell which ran
        ledger["seeds"] = {**(ledger.get("seeds") or {}), "torch": "withheld"}
        metrics["learning_rate_sweep"] = None
    else:
        ledger["random_stopping"] = {"runs": k, "chosen_run": best, "note": seed_secrecy.DERIVED_CAVEAT}
        metrics["learning_rate_sweep"] = [dict(d, run=i) for i, d in enumerate(state["done"])]
    if "evaluation" in chosen_eval:
        metrics["evaluation"] = chosen_eval["evaluation"]
    if not math.isfinite(float(chosen_eval.get("validation_loss", math.nan))):
        log.warning("every run diverged; releasing the first")

    _link_or_copy_tree(best_dir / layout.RUN_MODEL, Path(out_model))
    copy_train_log(best_dir / layout.TRAIN_LOG, out_train_log, bool(job.config["training"]["debug_step_log"]))
    if out_users is not None:
        copy_user_scores(best_dir / layout.EVAL_USERS, out_users)
    write_json(out_ledger, ledger)
    write_json(out_metrics, metrics)
    checkpoint.remove_checkpoint(work)  # raises when the secret state cannot be deleted
    log.info("released run with learning rate %s: validation loss %s, epsilon %.4g (%s)",
             fmt_num(metrics["learning_rate"]), metrics.get("validation_loss"), float(ledger["epsilon"]),
             ledger["epsilon_meaning"])
    return metrics


#: What a random-stopping job reads from the config that changes no result (its runs' and their evaluations').
RANDOM_STOPPING_UNTRACKED_KEYS = (*FINETUNE_UNTRACKED_KEYS, "evaluation.batch_size")


def job_config(settings: Mapping, untracked: Mapping, learning_rates: list[float], max_users: int | None) -> dict:
    """The config sections a random-stopping job reads, from rule random_stopping's params: those of its runs
    (userdp.training.targets.finetune_config: `settings`, `untracked` (RANDOM_STOPPING_UNTRACKED_KEYS of the
    config, userdp.untracked), `learning_rates`, the candidates) and of their evaluation (max_users;
    evaluation.batch_size from `untracked`)."""
    from ..training.targets import finetune_config

    job = finetune_config(settings, untracked, learning_rates)
    job["evaluation"] = {"max_users": max_users, "batch_size": int(untracked["evaluation"]["batch_size"])}
    return job


def job_from_cell(config: dict, cell: grid.Cell, **paths: Any) -> RandomStoppingJob:
    """The job of a grid cell (its wildcards from grid.Cell) with the rule's input paths."""
    return RandomStoppingJob(config=config, dataset=cell.dataset, method=cell.method, eps=cell.eps_text,
                             budget=str(cell.compute), seed=int(cell.seed), group=int(cell.group_size or 0),
                             option=cell.option, cell_dir=cell.run_dir, **paths)

