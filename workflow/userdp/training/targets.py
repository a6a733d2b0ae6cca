"""What changes a fine-tuning or pretraining job: the params of workflow/rules/train.smk (and of the audit's and
random stopping's fine-tuning), the job sizes (learning rates per job, runtime), and the config a job builds
from its params. The rules' files are written out in the .smk files.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Iterable, Mapping

from .. import layout
from ..io import sorted_dict
from ..privacy import seed_secrecy
from .settings import EXECUTION_TRAINING_KEYS, RESULT_TRAINING_KEYS

def uses_lora(config: dict) -> bool:
    """Whether fine-tuning trains LoRA adapters (model.lora), so run folders hold an adapter, not a model."""
    return bool(config["model"].get("lora"))


def learning_rate_texts(config: dict) -> list[str]:
    """training.learning_rates as path text (the `lr~...` of RUN_DIR), in config order."""
    return [layout.fmt_num(lr) for lr in config["training"]["learning_rates"]]


def per_cell_jobs(config: dict) -> bool:
    """training.sweep_jobs: one finetune (evaluate) job per cell for every learning rate, or one per run."""
    return config["training"].get("sweep_jobs", "per_cell") == "per_cell"


def rates_per_job(config: dict) -> int:
    """How many learning rates one job of rule finetune (and evaluate) trains (evaluates)."""
    return len(config["training"]["learning_rates"]) if per_cell_jobs(config) else 1


def sweep_runs(outputs: list[str], name: str, learning_rates: list[float]) -> list[tuple[float, str]]:
    """(learning rate, run folder) of each run a job writes, in order, from its outputs named `name`.

    name: the file that marks a run in the outputs (layout.LEDGER for rule finetune); the rate is the one of `learning_rates` whose path text is the folder's `lr~...`.
    """
    by_text = {layout.fmt_num(lr): float(lr) for lr in learning_rates}
    runs = []
    for path in outputs:
        p = PurePosixPath(path)
        if p.name != name:
            continue
        prefix, _, text = p.parent.name.partition("~")
        if prefix != "lr" or text not in by_text:
            raise ValueError(f"{path}: its folder is not a run folder of a rate in {sorted(by_text)} (lr~<rate>)")
        runs.append((by_text[text], str(p.parent)))
    return runs


def finetune_runtime(config: dict) -> int:
    """Minutes for one job of rule finetune: resources.finetune_runtime plus evaluation.runtime per learning rate
    it trains and evaluates."""
    return run_minutes(config) * rates_per_job(config)


def run_minutes(config: Mapping) -> int:
    """Minutes for one learning-rate run, trained and evaluated: resources.finetune_runtime + evaluation.runtime."""
    return int(config["resources"]["finetune_runtime"]) + int(config["evaluation"]["runtime"])




def model_spec(config: dict) -> dict[str, Any]:
    """What defines the base model: model.name when set, else the build spec and its pretraining."""
    m = config["model"]
    if m["name"]:
        return {"name": m["name"]}
    return sorted_dict({k: v for k, v in m.items() if k not in ("name", "lora")})


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


def finetune_params(config: dict, dataset: str) -> dict[str, Any]:
    """Everything a fine-tuning run of `dataset` depends on besides its input files and wildcards.

    Rule `finetune`'s `settings` param (and `finetune_group`'s): what
    userdp.training.settings declares (the training.* keys in
    RESULT_TRAINING_KEYS, the sequence length, the config seed,
    privacy.secret_seeds as resolved for this dataset and the model spec),
    plus `debug_step_log: true` only when training.debug_step_log is on (it
    adds the per-step columns to train_log.parquet; switching it on or off
    reruns the runs, while false and unset give the same params, so configs
    written before the option existed rerun nothing).
    """
    tr = config["training"]
    out = {
        "training": {k: tr.get(k) for k in RESULT_TRAINING_KEYS},
        "sequence_length": int(config["tokenizer"]["sequence_length"]),
        "seed": int(config["seed"]),
        "secret_seeds": seed_secrecy.secret_seeds(config, dataset),
        "model": model_spec(config),
    }
    if tr.get("debug_step_log"):
        out["debug_step_log"] = True
    if config["model"].get("lora"):  # only when set: configs without LoRA rerun nothing
        out["lora"] = dict(config["model"]["lora"])
    return sorted_dict(out)


#: The config keys a fine-tuning job reads that change no result (settings.EXECUTION_TRAINING_KEYS).
FINETUNE_UNTRACKED_KEYS = tuple(f"training.{k}" for k in EXECUTION_TRAINING_KEYS)


def pretrain_config(settings: Mapping) -> dict[str, Any]:
    """The config sections userdp.training.pretrain.pretrain reads, from rule pretrain's `settings` param
    (pretrain_params)."""
    return {"model": dict(settings["model"]), "tokenizer": {"sequence_length": int(settings["sequence_length"])},
            "seed": int(settings["seed"])}


def finetune_config(settings: Mapping, untracked_keys: Mapping, learning_rates: Iterable[float]) -> dict[str, Any]:
    """The config sections a fine-tuning job reads (finetune_job.run_job and train_run, TrainSettings.from_config),
    from rule finetune's params, `settings` (finetune_params) and `learning_rates`, and `untracked_keys`
    (`userdp.untracked.untracked` of FINETUNE_UNTRACKED_KEYS).
    The base model itself is the rule's `model` param; privacy.secret_seeds is the value
    resolved for the job's dataset (seed_secrecy.secret_seeds returns it as is)."""
    return {
        "seed": int(settings["seed"]),
        "model": {"lora": dict(settings["lora"]) if settings.get("lora") else None},
        "tokenizer": {"sequence_length": int(settings["sequence_length"])},
        "privacy": {"secret_seeds": bool(settings["secret_seeds"])},
        "training": {**settings["training"], **untracked_keys["training"],
                     "debug_step_log": bool(settings.get("debug_step_log", False)),
                     "learning_rates": [float(lr) for lr in learning_rates]},
    }
