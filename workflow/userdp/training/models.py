"""Models and tokenizers: load any causal LM, or build a small GPT-2/Llama from config.

With `model.name` set, any AutoModelForCausalLM name or path is loaded.
With `model.name: null` (the offline default) a small GPT-2 (or Llama-style)
model is built from `model.*` with the project tokenizer's vocabulary and
`n_positions = tokenizer.sequence_length`; it is then pretrained on public
text (`userdp.training.pretrain`). Dropout is 0 in built models: per-example
clipping sees the same function in its gradient and in the brute-force
reference, and resumed runs need no dropout RNG.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..errors import ConfigError, DataError
from ..io import atomic_dir

log = logging.getLogger(__name__)


def load_tokenizer(path: str | os.PathLike):
    """The project tokenizer saved by the data stage (a folder, or its tokenizer.json)."""
    from ..data.tokenize import load_tokenizer as load_project_tokenizer

    p = Path(path)
    folder = p.parent if p.name == "tokenizer.json" else p
    if not (folder / "tokenizer.json").exists():
        raise DataError(f"no tokenizer at {folder}: expected {folder / 'tokenizer.json'}; run the train_tokenizer rule first.")
    return load_project_tokenizer(folder)


def special_ids(tokenizer) -> dict[str, int]:
    """bos/eos/pad ids for a model config (pad falls back to eos, then 0)."""
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def build_model(model_cfg: dict[str, Any], vocab_size: int, sequence_length: int, ids: dict[str, int], seed: int) -> torch.nn.Module:
    """A freshly initialised small causal LM from `model.*` (architecture gpt2 or llama)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    n_embd, n_head = int(model_cfg["n_embd"]), int(model_cfg["n_head"])
    if n_embd % n_head:
        raise ConfigError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head}).")
    arch = model_cfg.get("architecture", "gpt2")
    tie = bool(model_cfg.get("tie_embeddings", True))
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size, n_positions=sequence_length, n_embd=n_embd, n_layer=int(model_cfg["n_layer"]),
            n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie, **ids,
        )
    elif arch == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=4 * n_embd,
            num_hidden_layers=int(model_cfg["n_layer"]), num_attention_heads=n_head, num_key_value_heads=n_head,
            max_position_embeddings=sequence_length, attention_dropout=0.0, tie_word_embeddings=tie, **ids,
        )
    else:
        raise ConfigError(f"model.architecture is {arch!r}; allowed values: ['gpt2', 'llama'].")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if tie and model.get_output_embeddings() is not None:
        model.tie_weights()
    return model


def lora_config(lora: dict[str, Any], fan_in_fan_out: bool = False):
    """peft's LoraConfig of `model.lora` (target_modules null = every linear layer but the output layer).

    fan_in_fan_out: the targets store W as [in, out] (GPT-2's Conv1D).
    """
    from peft import LoraConfig

    targets = lora.get("target_modules") or "all-linear"
    return LoraConfig(r=int(lora["r"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                      target_modules=targets, bias="none", task_type="CAUSAL_LM", fan_in_fan_out=fan_in_fan_out)


def apply_lora(model: torch.nn.Module, lora: Any, seed: int) -> torch.nn.Module:
    """`model` with LoRA adapters of `model.lora` (peft), only they trainable; `model` itself when lora is None.

    lora: the `model.lora` keys, or a peft LoraConfig used as it is (fan_in_fan_out set for GPT-2's Conv1D, as
    peft itself would). The adapters are initialised from `seed` (lora_A random, lora_B zero: the start is the
    base model).
    """
    if not lora:
        return model
    import copy

    from peft import LoraConfig, get_peft_model

    from transformers.pytorch_utils import Conv1D

    conv1d = any(isinstance(m, Conv1D) for m in model.modules())
    if isinstance(lora, LoraConfig):
        cfg = copy.deepcopy(lora)
        cfg.fan_in_fan_out = bool(cfg.fan_in_fan_out or conv1d)
        lora = {"r": cfg.r, "alpha": cfg.lora_alpha, "target_modules": cfg.target_modules}
    else:
        cfg = lora_config(lora, fan_in_fan_out=conv1d)
    torch.manual_seed(int(seed))
    try:
        peft_model = get_peft_model(model, cfg)
    except ValueError as exc:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, (torch.nn.Linear, Conv1D)) and n})
        raise ConfigError(f"model.lora.target_modules {lora.get('target_modules')!r} does not fit "
                          f"{type(model).__name__}: {str(exc).rstrip('.')}. Name linear modules of this model "
                          f"({', '.join(linear[:12])}) or leave it null for every linear layer.") from exc
    n_train = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    if n_train == 0:
        raise ConfigError(f"model.lora.target_modules {lora.get('target_modules')!r} matched no module of "
                          f"{type(model).__name__}: nothing would train.")
    log.info("LoRA r=%s alpha=%s on %s: %d trainable parameters of %d", lora["r"], lora["alpha"],
             sorted(peft_model.peft_config["default"].target_modules), n_train,
             sum(p.numel() for p in peft_model.parameters()))
    return peft_model


def is_adapter(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a saved LoRA adapter (peft) rather than a whole model."""
    from ..layout import ADAPTER_CONFIG

    return (Path(folder) / ADAPTER_CONFIG).exists()


def load_model(name_or_path: str | os.PathLike, device: torch.device | str = "cpu", *,
               local: bool = False, merge: bool = True) -> torch.nn.Module:
    """Load a causal LM in fp32 (weights stay fp32; bf16 is autocast only), in train mode.

    The one model loader of the package (fine-tuning, pretraining with
    model.name, evaluation). `name_or_path` is a Hugging Face hub id or a
    folder; with `local=True` it must be a folder written by save_pretrained
    (a pipeline artifact: a run's model/ or the pretrained model). A folder
    with a LoRA adapter is loaded on its base model (the one its adapter
    config names) and, with `merge`, merged into it (the same function as
    base + adapter, evaluated at the base model's speed).
    """
    from transformers import AutoModelForCausalLM

    text = str(name_or_path)
    if is_adapter(text):
        return _load_adapter(text, device, merge)
    if local and not (Path(text) / "config.json").exists():
        raise DataError(
            f"model folder {text} has no config.json; the training (or pretraining) rule should have "
            "written it with save_pretrained. Delete the folder and rerun that rule."
        )
    if text.startswith(("/", "./", "../", "~")) and not Path(text).expanduser().exists():
        # a local path, not a hub id ("org/name"): say so instead of the hub's repo-id complaint
        raise DataError(f"cannot load a causal LM from {text}: the folder does not exist (model.name is a local "
                        "path here; fix the path, or give a Hugging Face model id such as gpt2-medium).")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(Path(text).expanduser()) if text.startswith("~") else text,
                                                     dtype=torch.float32)
    except _LOAD_ERRORS as exc:
        raise DataError(_load_error(name_or_path, exc)) from exc
    return model.to(device)


# What a broken model folder raises while loading: missing or unreadable files (OSError), a config or model type
# transformers does not know or a shape mismatch (ValueError, KeyError; JSON errors are ValueErrors), truncated
# weights (SafetensorError; safetensors comes with transformers). Anything else is a bug and keeps its traceback.
_LOAD_ERRORS = (OSError, ValueError, KeyError, SafetensorError)


def _load_error(name: str | os.PathLike, exc: BaseException) -> str:
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return (f"cannot load a causal LM from {name}: {reason} ({type(exc).__name__}). If it is a folder, its "
            "config.json or weights are damaged or from a newer transformers: copy it again or save it again with "
            "save_pretrained; a hub id must exist on the hub.")


def _load_adapter(folder: str, device: torch.device | str, merge: bool) -> torch.nn.Module:
    from peft import PeftConfig, PeftModel

    try:
        base_name = PeftConfig.from_pretrained(folder).base_model_name_or_path
    except _LOAD_ERRORS as exc:
        raise DataError(f"the LoRA adapter in {folder} cannot be read: its adapter_config.json is damaged "
                        f"({str(exc).strip()[:200] or type(exc).__name__}); copy the folder again or retrain the "
                        "run.") from exc
    if not base_name:
        raise DataError(f"the LoRA adapter in {folder} names no base model (adapter_config.json "
                        "base_model_name_or_path); retrain the run.")
    try:
        base = load_model(base_name, device)
    except DataError as exc:
        raise DataError(f"the LoRA adapter in {folder} is for the base model {base_name}, which cannot be "
                        f"loaded: {exc}") from exc
    try:
        model = PeftModel.from_pretrained(base, folder)
    except _LOAD_ERRORS as exc:
        raise DataError(f"the LoRA adapter in {folder} cannot be loaded on {base_name}: "
                        f"{str(exc).strip()[:300] or type(exc).__name__}; copy the folder again or retrain the "
                        "run.") from exc
    model = model.merge_and_unload() if merge else model
    return model.to(device)


def save_model_atomic(model: torch.nn.Module, out_dir: str | os.PathLike) -> None:
    """save_pretrained into a temporary sibling folder, then rename it to `out_dir`.

    Snakemake may have created `out_dir` (empty) for the job's outputs; it is
    replaced. A killed job leaves only a hidden temporary folder behind.
    """
    with atomic_dir(out_dir) as tmp:  # the permissions of every other artifact, so group members can read it
        model.save_pretrained(str(tmp))


def check_model_fits(model: torch.nn.Module, name: str, tokenizer: Any, sequence_length: int | None) -> None:
    """ConfigError unless the model has an embedding for every token and a position for every one of
    `sequence_length` tokens (fine-tuning's base model; `userdp.evaluate`'s model)."""
    vocab = model.get_input_embeddings().num_embeddings
    if vocab < len(tokenizer):
        raise ConfigError(
            f"model {name} has {vocab} token embeddings but the tokenizer has {len(tokenizer)} tokens; set "
            f"tokenizer.name to the model's own tokenizer (model.name {name!r})."
        )
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if sequence_length is not None and positions is not None and int(sequence_length) > int(positions):
        raise ConfigError(f"tokenizer.sequence_length is {sequence_length} but model {name} has {positions} "
                          f"positions; set it to at most {positions}.")


def resolve_device(name: str) -> torch.device:
    """training.device (used by fine-tuning and evaluation): auto = cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'.")
    return torch.device(name)


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast on CUDA; a no-op elsewhere (CPU runs in fp32)."""
    import contextlib

    if precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
