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
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, DataError

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


def load_model(name_or_path: str | os.PathLike, device: torch.device | str = "cpu", *,
               local: bool = False) -> torch.nn.Module:
    """Load a causal LM in fp32 (weights stay fp32; bf16 is autocast only), in train mode.

    The one model loader of the package (fine-tuning, pretraining with
    model.name, evaluation). `name_or_path` is a Hugging Face hub id or a
    folder; with `local=True` it must be a folder written by save_pretrained
    (a pipeline artifact: a run's model/ or the pretrained model).
    """
    from transformers import AutoModelForCausalLM

    text = str(name_or_path)
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
    except OSError as exc:
        raise DataError(f"cannot load a causal LM from {name_or_path}: {exc}") from exc
    return model.to(device)


def save_model_atomic(model: torch.nn.Module, out_dir: str | os.PathLike) -> None:
    """save_pretrained into a temporary sibling folder, then rename it to `out_dir`.

    Snakemake may have created `out_dir` (empty) for the job's outputs; it is
    replaced. A killed job leaves only a hidden temporary folder behind.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp))
        # mkdtemp makes 0700 (and some writers 0600 files): give the model the
        # permissions of every other artifact, so group members can read it.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for f in tmp.rglob("*"):
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
