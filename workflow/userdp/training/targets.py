"""Helpers for workflow/rules/train.smk: run targets and rule inputs.

Kept in the library (not in the .smk file) so the rules stay declarative and
the path logic is unit-testable.
"""

from __future__ import annotations

from typing import Any

from ..config import fmt_num, iter_cells

PRETRAINED = "results/model/pretrained"
PRETRAINED_FILES = (f"{PRETRAINED}/model.safetensors", f"{PRETRAINED}/config.json")
RUN_FILES = ("ledger.json", "train_log.parquet", "model/config.json", "model/model.safetensors")


def run_dirs(config: dict) -> list[str]:
    """Every run folder: each grid cell (userdp.config.iter_cells) x training.learning_rates."""
    return [f"{cell.run_dir}/lr~{fmt_num(lr)}" for cell in iter_cells(config)
            for lr in config["training"]["learning_rates"]]


def train_targets(config: dict) -> list[str]:
    """The files rule `finetune` writes for every run (plus the pretrained model if it is built)."""
    out = [f"{d}/{name}" for d in run_dirs(config) for name in RUN_FILES]
    if not config["model"]["name"]:
        out += list(PRETRAINED_FILES)
    return out


def pretrain_inputs(config: dict) -> dict[str, str]:
    """Inputs of rule `pretrain`: the tokenizer, and the public tokens when there is pretraining to do."""
    from .pretrain import public_tokens_path

    ins = {"tokenizer": "results/tokenizer/tokenizer.json"}
    if not config["model"]["name"] and config["model"]["pretrain"]["steps"] > 0:
        ins["public"] = public_tokens_path(config)
    return ins


def finetune_inputs(config: dict, wildcards: Any) -> dict[str, str]:
    """Inputs of rule `finetune` (and `finetune_group`) for one run."""
    plan = f"results/plan/{wildcards.dataset}/method~{wildcards.method}/eps~{wildcards.eps}/budget~{wildcards.budget}"
    group = wildcards.get("group") if hasattr(wildcards, "get") else getattr(wildcards, "group", None)
    ins = {
        "plan": f"{plan}/group~{group}.json" if group else f"{plan}.json",
        "tokens": f"results/data/{wildcards.dataset}/tokens.parquet",
        "tokenizer": "results/tokenizer/tokenizer.json",
    }
    # A named model (model.name) is loaded as is; the small default comes from `pretrain`.
    if not config["model"]["name"]:
        ins["model"], ins["model_config"] = PRETRAINED_FILES
    return ins


def base_model(config: dict) -> str:
    """What `finetune` loads: model.name, or the pretrained folder."""
    return config["model"]["name"] or PRETRAINED
