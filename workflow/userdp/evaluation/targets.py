"""File lists of the evaluation rules (used by evaluate.smk; the LM figures: userdp.plotting.registry).

Kept in the library so the rule files hold only rules (Snakemake's linter
asks for that) and so the lists can be unit-tested.
"""

from __future__ import annotations

import math
from typing import Mapping

from .. import grid, layout
from ..training.targets import learning_rate_texts


#: The config keys an evaluation reads that change no metric beyond float rounding (right padding plus masking
#: makes the loss independent of how sequences are batched; evaluation draws no random numbers on the device):
#: the scripts of rules finetune, evaluate_pretrained and audit_score read them from the config
#: (userdp.untracked), not as params, so changing them reruns nothing (tests/test_rerun_triggers.py, tests/test_eval_metrics.py).
EVALUATE_UNTRACKED_KEYS = ("evaluation.batch_size", "training.device")

#: The held-out splits an evaluation can score (training users are never evaluated).
EVAL_SPLITS = ("validation", "test")

#: Columns of the per-user scores (`metrics.per_user_scores`; the artifact eval_users.parquet,
#: docs/artifacts.md). Here, not in metrics.py, so that readers of the artifact (groups) need no torch.
USER_SCORE_COLUMNS = ("user_id", "nll", "n_tokens", "n_examples", "loss")


def evaluated_splits(config: Mapping, *, selects: bool) -> list[str]:
    """The splits an evaluation scores (in its rule's params, so changing the choice reruns it).

    Test users always (every figure and finding reads test metrics); validation users only where a choice
    reads them, a cell choosing among several learning rates (`selects`), unless evaluation.validation is
    `always`. Random stopping scores its runs on both itself (userdp.evaluation.random_stopping).
    """
    if selects or config["evaluation"]["validation"] == "always":
        return list(EVAL_SPLITS)
    return ["test"]


def split_params(config: Mapping, *, selects: bool) -> dict[str, list[str]]:
    """The evaluations' `splits` entry: absent where both splits are scored (as before the key existed), so
    upgrading reruns only the evaluations whose splits change (the scripts read the default)."""
    splits = evaluated_splits(config, selects=selects)
    return {} if splits == list(EVAL_SPLITS) else {"splits": splits}


def evaluation_params(config: Mapping) -> dict:
    """Rule finetune's `evaluation` param, what changes its runs' metrics besides their models and the tokens:
    which held-out users (evaluation.max_users, the config seed) and which splits (`split_params`: validation
    users where the cell chooses among several learning rates)."""
    return {"max_users": config["evaluation"]["max_users"], "seed": config["seed"],
            **split_params(config, selects=len(config["training"]["learning_rates"]) > 1)}


def run_file(dataset: str, cell: str, lr: str, name: str) -> str:
    """File `name` of the run folder (layout.RUN_DIR) of one learning rate of a cell."""
    return f"{layout.RUN_DIR.format(dataset=dataset, cell=cell, lr=lr)}/{name}"


def cell_user_scores(config: Mapping, dataset: str) -> list[str]:
    """The per-user test scores (users.parquet) of every cell of `dataset`'s grid (rule groups' input), in the
    order of `grid.iter_cells`."""
    return [f"{c.run_dir}/{layout.USER_SCORES}" for c in grid.iter_cells(config) if c.dataset == dataset]


def lr_run_files(config: Mapping, dataset: str, cell: str, name: str) -> list[str]:
    """`name` (eval.json, ledger.json, ...) of each learning rate's run of a cell, in config order."""
    return [run_file(dataset, cell, lr, name) for lr in learning_rate_texts(config)]


def pretrained_model_files(config: Mapping) -> list[str]:
    """Files of the pretrained model; none for a hub model (model.name)."""
    return [] if config["model"]["name"] else layout.model_files(layout.PRETRAINED)


# Rule aggregate's named inputs (read by userdp.evaluation.aggregate.build_summary):
# one file per cell in each list, the cells in the same order.
SUMMARY_INPUTS = ("plans", "metrics", "ledgers", "train_logs")


def summary_inputs(config: dict, dataset: str) -> dict[str, list[str]]:
    """Plan, metrics, ledger and train log of every cell of `dataset` (rule aggregate's inputs, cell by cell)."""
    cells = [c for c in grid.iter_cells(config) if c.dataset == dataset]
    files = (
        [c.plan_path for c in cells],
        [f"{c.run_dir}/{layout.METRICS}" for c in cells],
        [f"{c.run_dir}/{layout.LEDGER}" for c in cells],
        [f"{c.run_dir}/{layout.TRAIN_LOG}" for c in cells],
    )
    return dict(zip(SUMMARY_INPUTS, files))


def evaluation_targets(config: dict) -> list[str]:
    """Every cell's metrics.json, the pretrained metrics, the summaries and the group tables."""
    out = [f"{cell.run_dir}/{layout.METRICS}" for cell in grid.iter_cells(config)]
    for name in grid.grid_datasets(config):
        out += [t.format(dataset=name)
                for t in (layout.PRETRAINED_METRICS, layout.SUMMARY, layout.SUMMARY_CSV, layout.TRAIN_CURVES,
                          layout.SUMMARY_USERS, layout.GROUPS, layout.GROUPS_CSV)]
    return out


def groups_inputs(config: Mapping, dataset: str) -> dict[str, list[str] | str]:
    """Rule groups' inputs: every cell's and the pretrained model's per-user test scores, the summary (each
    cell's G) and, where the dataset labels its users (userdp.data.labels), the labels."""
    from ..data.labels import has_labels

    out: dict[str, list[str] | str] = {
        "cells": cell_user_scores(config, dataset),
        "pretrained": layout.PRETRAINED_USER_SCORES.format(dataset=dataset),
        "summary": layout.SUMMARY.format(dataset=dataset),
    }
    if has_labels(config["datasets"][dataset]):
        out["labels"] = layout.USER_LABELS.format(dataset=dataset)
    return out


def random_stopping(config: Mapping) -> bool:
    """Whether private cells select by random stopping (privacy.selection.accounting: random_stopping)."""
    from ..privacy.selection import mode_of

    return mode_of(config) == "random_stopping"


def select_lr_cells(config: Mapping) -> str:
    """Rule select_lr's `{cell}` constraint: every cell, or only eps~inf ones under random stopping.

    Under random stopping each private cell is rule random_stopping's (one job: a random number of runs,
    the best released, userdp.evaluation.random_stopping); the non-private references keep the sweep.
    """
    return layout.NON_PRIVATE_CELL_RE if random_stopping(config) else layout.CELL_RE


def random_stopping_inputs(config: dict, dataset: str, cell: str) -> dict[str, str]:
    """Inputs of rule random_stopping for one cell: its plan, tokens, tokenizer and base model (as finetune's)."""
    from ..training.targets import finetune_inputs

    c = grid.cell_of_dir(layout.CELL_DIR.format(dataset=dataset, cell=cell), config)
    wildcards = {"dataset": dataset, "method": c.method, "eps": c.eps_text, "budget": c.compute,
                 "group": c.group_size}
    return finetune_inputs(config, _Wildcards(wildcards))


class _Wildcards(dict):
    """A dict readable like Snakemake's wildcards (attributes and .get)."""

    __getattr__ = dict.__getitem__


def random_stopping_runtime(config: Mapping) -> int:
    """Minutes for one random-stopping job: 3 x the mean number of runs, each a finetune and an evaluation.

    K exceeds 3 x its mean with probability about exp(-3) (geometric); such a job is killed at its runtime
    and resumes where it stopped when rerun.
    """
    from ..privacy.selection import Selection

    sel = Selection.from_config(config["privacy"], config["training"]["learning_rates"])
    runs = math.ceil(3 * float(sel.mean_runs or 1))
    return int(runs * (int(config["resources"]["finetune_runtime"]) + int(config["evaluation"]["runtime"])))


def released_model_outputs(config: Mapping) -> dict[str, str]:
    """Rule random_stopping's model outputs: the released model's (or adapter's) files in the cell folder."""
    from ..training.targets import run_outputs

    outs = run_outputs(layout.CELL_DIR, config)
    return {"model": outs["model"], "model_config": outs["model_config"]}
