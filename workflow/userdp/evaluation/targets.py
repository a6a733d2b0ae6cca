"""File lists of the evaluation rules (used by evaluate.smk; the LM figures: userdp.plotting.registry).

Kept in the library so the rule files hold only rules (Snakemake's linter
asks for that) and so the lists can be unit-tested.
"""

from __future__ import annotations

from typing import Mapping

from .. import layout


def learning_rate_texts(config: Mapping) -> list[str]:
    """training.learning_rates as path text (lr~0.001)."""
    return [layout.fmt_num(lr) for lr in config["training"]["learning_rates"]]


def run_file(dataset: str, cell: str, lr: str, name: str) -> str:
    """File `name` of the run folder (layout.RUN_DIR) of one learning rate of a cell."""
    return f"{layout.RUN_DIR.format(dataset=dataset, cell=cell, lr=lr)}/{name}"


def run_model_files(dataset: str, cell: str, lr: str) -> list[str]:
    """The fine-tuned model files the training rule writes for one learning rate."""
    return layout.model_files(run_file(dataset, cell, lr, layout.RUN_MODEL))


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
    cells = [c for c in layout.iter_cells(config) if c.dataset == dataset]
    files = (
        [c.plan_path for c in cells],
        [f"{c.run_dir}/{layout.METRICS}" for c in cells],
        [f"{c.run_dir}/{layout.LEDGER}" for c in cells],
        [f"{c.run_dir}/{layout.TRAIN_LOG}" for c in cells],
    )
    return dict(zip(SUMMARY_INPUTS, files))


def evaluation_targets(config: dict) -> list[str]:
    """Every cell's metrics.json, the pretrained metrics and the summaries."""
    out = [f"{cell.run_dir}/{layout.METRICS}" for cell in layout.iter_cells(config)]
    for name in layout.grid_datasets(config):
        out += [t.format(dataset=name)
                for t in (layout.PRETRAINED_METRICS, layout.SUMMARY, layout.SUMMARY_CSV, layout.TRAIN_CURVES)]
    return out
