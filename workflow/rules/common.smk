# Shared set-up: config validation, wildcard constraints, target lists.
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))  # also when a test's Snakefile includes only this

from userdp import grid, layout
from userdp.config import validate_config
from userdp.privacy import memo
from userdp.errors import ConfigError
from snakemake.exceptions import WorkflowError

# A target written after --configfile is read as one more config file (argparse takes every word up to the
# next option); an artifact read as config would then be reported as unknown config keys.
_targets_as_config = [str(f) for f in workflow.overwrite_configfiles if layout.looks_like_artifact(str(f))]
if _targets_as_config:
    raise WorkflowError(
        f"--configfile got {', '.join(_targets_as_config)}, which look like targets (pipeline artifacts), not "
        "config files: --configfile takes every word after it. Put targets first: "
        "snakemake TARGET ... --configfile my.yaml"
    )

# The jobs share one memo of accountant results (the plan's, the ledgers' and selection's epsilons are the same
# computations); USERDP_ACCOUNTING_MEMO="" turns it off.
os.environ.setdefault(memo.ENV, layout.ACCOUNTING_MEMO)

# torch's CPU allocator puts tensors of 2 MB and more on transparent huge pages: a training or evaluation step
# allocates its logits and activations afresh, and with 4 KB pages most of a job's system time was their page
# faults (docs/performance.md, "Huge pages"). Same numbers; THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


try:
    validate_config(config, source="config (config/config.yaml and --configfile/--config)")
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None


# Scheduling order among ready jobs (snakemake's `priority:`, higher first). The data stage and pretraining
# are one chain that every fine-tuning job waits for, so it goes first; then the plans the fine-tuning jobs
# need; the accounting comparison and the mean-estimation study (independent of the language model) fill a
# core beside the fine-tuning jobs instead of waiting for the end, and so do the figures whose inputs are
# ready early (the mean-estimation, noise and contribution figures); fine-tuning (each job evaluates its runs
# too) before the pretrained model's evaluation keeps the long jobs early and the short ones for the tail; a
# cell's learning-rate selection (a fraction of a second) runs as soon as its fine-tuning job is done, so the
# tail after the last fine-tuning job is one cell's selection, the summary and the figures that read it; the
# summary, the user-group analysis and the findings go before those figures (two figures and the findings wait
# for them). Order only: no job's result depends on it.
PRIORITY = dict(chain=100, plan=60, summary=58, side=55, finetune=50, select=45, evaluate=40)


# Every wildcard of the path templates (userdp.layout.WILDCARD_RES).
wildcard_constraints:
    **layout.WILDCARD_RES,


def data_targets():
    from userdp.data.labels import has_labels

    out = []
    for name in config["datasets"]:
        out.append(layout.CONTRIBUTIONS.format(dataset=name))
    for name in grid.grid_datasets(config):
        out.append(layout.TOKENS.format(dataset=name))
        if has_labels(config["datasets"][name]):
            out.append(layout.USER_LABELS.format(dataset=name))
    return out


def plan_targets():
    return [cell.plan_path for cell in grid.iter_cells(config)] + [
        layout.ACCOUNTING_COMPARISON,
    ]


def all_targets():
    from userdp.training.targets import train_targets
    from userdp.evaluation.targets import evaluation_targets
    from userdp.experiments.targets import workflow_targets as mean_estimation_targets
    from userdp.plotting.registry import figure_targets
    from userdp.evaluation.findings_job import targets as findings_targets

    return (
        data_targets()
        + plan_targets()
        + train_targets(config)
        + evaluation_targets(config)
        + mean_estimation_targets()
        + figure_targets(config)
        + findings_targets(config)
    )
