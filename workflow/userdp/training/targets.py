"""Helpers for workflow/rules/train.smk: run targets and rule inputs.

Kept in the library (not in the .smk file) so the rules stay declarative and
the path logic is unit-testable. The paths are userdp.layout's templates.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Iterable, Mapping

from .. import grid, layout
from ..errors import ConfigError
from ..io import sorted_dict
from ..privacy import seed_secrecy
from ..privacy.selection import one_job
from .settings import EXECUTION_TRAINING_KEYS, RESULT_TRAINING_KEYS

# The files rule `pretrain` writes (weights, config).
PRETRAINED_FILES = (f"{layout.PRETRAINED}/{layout.MODEL_WEIGHTS}", f"{layout.PRETRAINED}/{layout.MODEL_CONFIG}")
def uses_lora(config: dict) -> bool:
    """Whether fine-tuning trains LoRA adapters (model.lora), so run folders hold an adapter, not a model."""
    return bool(config["model"].get("lora"))


def run_model_files(folder: str, config: dict) -> list[str]:
    """The files of a fine-tuned model folder: the whole model, or its LoRA adapter under model.lora."""
    return layout.model_files(folder, adapter=uses_lora(config))


def run_outputs(run_dir: str, config: dict) -> dict[str, str]:
    """The outputs of rule `finetune` (by name) for a run folder or run-folder template.

    `model` and `model_config` are the saved model's weights and config, or under model.lora the adapter's.
    """
    config_file, weights = run_model_files(f"{run_dir}/{layout.RUN_MODEL}", config)
    return {"ledger": f"{run_dir}/{layout.LEDGER}", "train_log": f"{run_dir}/{layout.TRAIN_LOG}",
            "model": weights, "model_config": config_file}


def learning_rate_texts(config: dict) -> list[str]:
    """training.learning_rates as path text (the `lr~...` of RUN_DIR), in config order."""
    return [layout.fmt_num(lr) for lr in config["training"]["learning_rates"]]


def per_cell_jobs(config: dict) -> bool:
    """training.sweep_jobs: one finetune (evaluate) job per cell for every learning rate, or one per run."""
    return config["training"].get("sweep_jobs", "per_cell") == "per_cell"


def rates_per_job(config: dict) -> int:
    """How many learning rates one job of rule finetune (and evaluate) trains (evaluates)."""
    return len(config["training"]["learning_rates"]) if per_cell_jobs(config) else 1


def lr_dirs(run_dir: str, config: dict) -> list[str]:
    """The run folders one job writes, from a run-folder template with an `{lr}` wildcard.

    training.sweep_jobs per_cell: the folder of every learning rate, in config order (other wildcards such as
    {dataset} or {cell} stay templates); per_run: the template itself (the job's {lr} wildcard names its rate).
    """
    if not per_cell_jobs(config):
        return [run_dir]
    return [run_dir.replace("{lr}", lr) for lr in learning_rate_texts(config)]


def sweep_outputs(run_dir: str, config: dict) -> list[str]:
    """The outputs of one job of rule `finetune`, run folder by run folder (`lr_dirs`, in order): its
    `run_outputs` and its evaluation on held-out users (eval.json, eval_users.parquet)."""
    return [path for d in lr_dirs(run_dir, config)
            for path in [*run_outputs(d, config).values(), f"{d}/{layout.EVAL}", f"{d}/{layout.EVAL_USERS}"]]


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
    return (int(config["resources"]["finetune_runtime"]) + int(config["evaluation"]["runtime"])) \
        * rates_per_job(config)


def run_dirs(config: dict) -> list[str]:
    """Every run folder: each grid cell (userdp.grid.iter_cells) x training.learning_rates.

    Under random stopping (privacy.selection) a private cell has no run folder per learning rate: one
    job trains its runs out of sight and releases the best into the cell folder (`released_models`).
    """
    return [cell.lr_dir(lr) for cell in grid.iter_cells(config) if not one_job(config, cell.epsilon)
            for lr in config["training"]["learning_rates"]]


def released_models(config: dict) -> list[str]:
    """The model files of the cells selected by random stopping (their RUN_MODEL in the cell folder)."""
    return [path for cell in grid.iter_cells(config) if one_job(config, cell.epsilon)
            for path in run_model_files(f"{cell.run_dir}/{layout.RUN_MODEL}", config)]


def train_targets(config: dict) -> list[str]:
    """The files rule `finetune` writes for every run (plus the pretrained model if it is built)."""
    out = [path for d in run_dirs(config) for path in run_outputs(d, config).values()] + released_models(config)
    if not config["model"]["name"]:
        out += list(PRETRAINED_FILES)
    return out


def public_tokens_path(config: dict) -> str:
    """Path of the public tokens pretraining reads; ConfigError when there is no public corpus."""
    from ..data.tokenize import public_dataset_name

    name = public_dataset_name(config)
    if name is None:
        raise ConfigError(
            "model.name is null (build and pretrain a small model) but no dataset has a public part; "
            "set tokenizer.public_dataset to a dataset with public text, or set model.name to a pretrained model."
        )
    return layout.PUBLIC_TOKENS.format(dataset=name)


def pretrain_inputs(config: dict) -> dict[str, str]:
    """Inputs of rule `pretrain`: the tokenizer, and the public tokens when there is pretraining to do."""
    ins = {"tokenizer": layout.TOKENIZER}
    if not config["model"]["name"] and config["model"]["pretrain"]["steps"] > 0:
        ins["public"] = public_tokens_path(config)
    return ins


def finetune_inputs(config: dict, wildcards: Any) -> dict[str, str]:
    """Inputs of rule `finetune` (and `finetune_group`) for one run."""
    group = wildcards.get("group") if hasattr(wildcards, "get") else getattr(wildcards, "group", None)
    cell = {k: getattr(wildcards, k) for k in ("dataset", "method", "eps", "budget")}
    ins = {
        "plan": (layout.GROUP_PLAN if group else layout.PLAN).format(**cell, group=group),
        "tokens": layout.TOKENS.format(dataset=wildcards.dataset),
        "tokenizer": layout.TOKENIZER,
    }
    # A named model (model.name) is loaded as is; the small default comes from `pretrain`.
    if not config["model"]["name"]:
        ins["model"], ins["model_config"] = PRETRAINED_FILES
    return ins


def base_model(config: dict) -> str:
    """What `finetune` loads: model.name, or the pretrained folder."""
    return config["model"]["name"] or layout.PRETRAINED


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
