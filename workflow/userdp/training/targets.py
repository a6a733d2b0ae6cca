"""Helpers for workflow/rules/train.smk: run targets and rule inputs.

Kept in the library (not in the .smk file) so the rules stay declarative and
the path logic is unit-testable.
"""

from __future__ import annotations

from typing import Any

from ..config import fmt_num, iter_cells
from ..config import sorted_dict

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


# training.* keys that change the trained model. Left out on purpose (changing
# them reruns nothing): threads, gpus (data-parallel ranks give the one-process
# result up to float summation order), physical_batch_size (micro-batching sums
# the same clipped per-unit gradients, only in another order; the ledger still
# records the value the run used), checkpoint_every (a resumed run continues
# the same RNG streams), learning_rates (the rate is the {lr} wildcard).
# device IS kept: the noise is drawn from a generator on that device and the
# CPU and CUDA generators give different streams, so a run on another device
# is another draw of the mechanism, not the same result with other rounding.
FINETUNE_TRAINING_KEYS = ("optimizer", "schedule", "warmup_steps", "precision", "uls_examples_per_user", "device")


def model_spec(config: dict) -> dict[str, Any]:
    """What defines the base model: model.name when set, else the build spec and its pretraining."""
    m = config["model"]
    if m["name"]:
        return {"name": m["name"]}
    return sorted_dict({k: v for k, v in m.items() if k != "name"})


def pretrain_params(config: dict) -> dict[str, Any]:
    """Everything rule `pretrain`'s result depends on besides its input files (its `settings` param).

    The tokenizer (hence the vocabulary and special ids) is an input file, so a
    tokenizer change reruns pretraining through it; the sequence length sets
    n_positions and the pretraining window, so it is here.
    """
    return sorted_dict({
        "model": model_spec(config),
        "sequence_length": int(config["tokenizer"]["sequence_length"]),
        "seed": int(config["seed"]),
    })


def finetune_params(config: dict) -> dict[str, Any]:
    """Everything a fine-tuning run's result depends on besides its input files and wildcards.

    Rule `finetune`'s `settings` param (and `finetune_group`'s): the training.*
    keys in FINETUNE_TRAINING_KEYS, the sequence length (micro-batch width),
    the config seed (bounding and run seeds), privacy.secret_seeds (where the
    sampling and noise randomness comes from) and the model spec.
    """
    tr = config["training"]
    return sorted_dict({
        "training": {k: tr.get(k) for k in FINETUNE_TRAINING_KEYS},
        "sequence_length": int(config["tokenizer"]["sequence_length"]),
        "seed": int(config["seed"]),
        "secret_seeds": bool(config["privacy"].get("secret_seeds", False)),
        "model": model_spec(config),
    })
