"""What changes an evaluation: the evaluation params of rules finetune, evaluate_pretrained, select_lr and
random_stopping, and the keys that change no metric (read from the config, not params).

The rules' files are written out in workflow/rules/*.smk; these are the values they carry as params, kept in
the library so that they are unit-tested.
"""

from __future__ import annotations

import math
from typing import Mapping

from .. import layout


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

#: The metrics of one scored split (`metrics.summarise`), eval.json's `{split}_{name}` fields.
METRIC_NAMES = ("loss", "loss_user_macro", "perplexity", "accuracy", "n_tokens", "n_examples", "n_users")


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


def evaluation_params(config: Mapping, *, selects: bool | None = None) -> dict:
    """What changes an evaluation's metrics besides its model and the tokens: which held-out users
    (evaluation.max_users, the config seed) and which splits (`split_params`). `selects`: whether the
    evaluated runs are choices (validation users too); None, as rule finetune's `evaluation` param: where the
    cell chooses among several learning rates. Rule evaluate_pretrained (False) and rule random_stopping
    (True) spread it into their params."""
    if selects is None:
        selects = len(config["training"]["learning_rates"]) > 1
    return {"max_users": config["evaluation"]["max_users"], "seed": config["seed"],
            **split_params(config, selects=selects)}


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


def random_stopping_runtime(config: Mapping) -> int:
    """Minutes for one random-stopping job: 3 x the mean number of runs, each a finetune and an evaluation.

    K exceeds 3 x its mean with probability about exp(-3) (geometric); such a job is killed at its runtime
    and resumes where it stopped when rerun.
    """
    from ..privacy.selection import Selection
    from ..training.targets import run_minutes

    sel = Selection.from_config(config["privacy"], config["training"]["learning_rates"])
    return math.ceil(3 * float(sel.mean_runs or 1)) * run_minutes(config)


