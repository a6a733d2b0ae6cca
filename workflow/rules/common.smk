# Shared set-up: config validation, wildcard constraints, target lists.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from userdp.config import validate_config, iter_cells, grid_datasets, fmt_num
from userdp.errors import ConfigError
from snakemake.exceptions import WorkflowError

try:
    validate_config(config, source="config (config/config.yaml and --configfile/--config)")
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None


wildcard_constraints:
    dataset=r"[A-Za-z0-9_-]+",
    method=r"els|uls",
    eps=r"inf|[0-9]+(\.[0-9]+)?(e-?[0-9]+)?",
    budget=r"[0-9]+",
    seed=r"[0-9]+",
    group=r"[0-9]+",


def data_targets():
    out = []
    for name in config["datasets"]:
        out += [
            f"results/data/{name}/contributions.json",
            f"results/figures/contributions_{name}.png",
        ]
    for name in grid_datasets(config):
        out.append(f"results/data/{name}/tokens.parquet")
    return out


def plan_targets():
    return [cell.plan_path for cell in iter_cells(config)] + [
        "results/accounting/comparison.parquet",
        "results/figures/noise_vs_group_size.png",
    ]


def all_targets():
    from userdp.training.targets import train_targets
    from userdp.evaluation.targets import evaluation_targets
    from userdp.experiments.mean_estimation import workflow_targets as mean_estimation_targets

    return (
        data_targets()
        + plan_targets()
        + train_targets(config)
        + evaluation_targets(config)
        + mean_estimation_targets()
    )
