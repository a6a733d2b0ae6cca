"""File lists of the evaluation and LM-figure rules (used by evaluate.smk / figures.smk).

Kept in the library so the rule files hold only rules (Snakemake's linter
asks for that) and so the lists can be unit-tested.
"""

from __future__ import annotations

from typing import Mapping

from ..config import fmt_num, grid_datasets, iter_cells

PRETRAINED_DIR = "results/model/pretrained"
MODEL_FILES = ("config.json", "model.safetensors")
LM_FIGURES = ("lm_loss_vs_epsilon", "lm_loss_vs_budget", "lm_loss_vs_group_size", "training_curves")
# A grid cell's folder below results/runs/{dataset}/: main cells and G-sweep cells.
CELL_REGEX = r"method~(?:els|uls)/eps~[^/]+/budget~[0-9]+(?:/group~[0-9]+)?/seed~[0-9]+"
LR_REGEX = r"[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?"


def learning_rate_texts(config: Mapping) -> list[str]:
    """training.learning_rates as path text (lr~0.001)."""
    return [fmt_num(lr) for lr in config["training"]["learning_rates"]]


def run_model_files(dataset: str, cell: str, lr: str) -> list[str]:
    """The fine-tuned model files the training rule writes for one learning rate."""
    return [f"results/runs/{dataset}/{cell}/lr~{lr}/model/{f}" for f in MODEL_FILES]


def lr_run_files(config: Mapping, dataset: str, cell: str, name: str) -> list[str]:
    """`name` (eval.json, ledger.json, ...) of each learning rate's run of a cell, in config order."""
    return [f"results/runs/{dataset}/{cell}/lr~{lr}/{name}" for lr in learning_rate_texts(config)]


def pretrained_model_files(config: Mapping) -> list[str]:
    """Files of the pretrained model; none for a hub model (model.name)."""
    return [] if config["model"]["name"] else [f"{PRETRAINED_DIR}/{f}" for f in MODEL_FILES]


def summary_inputs(config: dict, dataset: str) -> dict[str, list[str]]:
    """Plan, metrics, ledger and train log of every cell of `dataset`."""
    cells = [c for c in iter_cells(config) if c.dataset == dataset]
    return {
        "plans": [c.plan_path for c in cells],
        "metrics": [f"{c.run_dir}/metrics.json" for c in cells],
        "ledgers": [f"{c.run_dir}/ledger.json" for c in cells],
        "train_logs": [f"{c.run_dir}/train_log.parquet" for c in cells],
    }


def lm_figure_targets(dataset: str) -> list[str]:
    """PNG and PDF of every LM figure of one dataset."""
    return [f"results/figures/{name}_{dataset}.{ext}" for name in LM_FIGURES for ext in ("png", "pdf")]


def evaluation_targets(config: dict) -> list[str]:
    """Every cell's metrics.json, the pretrained metrics, the summaries and the LM figures."""
    out = [f"{cell.run_dir}/metrics.json" for cell in iter_cells(config)]
    for name in grid_datasets(config):
        out += [
            f"results/runs/{name}/pretrained/metrics.json",
            f"results/summary/{name}/metrics.parquet",
            f"results/summary/{name}/metrics.csv",
            f"results/summary/{name}/train_curves.parquet",
        ]
        out += lm_figure_targets(name)
    return out
