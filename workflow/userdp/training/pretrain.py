"""Non-private pretraining of the small default model on public text.

The offline default (`model.name: null`) has no pretrained checkpoint to
download, so a small GPT-2 is built from `model.*` and trained for
`model.pretrain.steps` steps of ordinary (non-private) next-token training
on the public corpus's tokens. Public data carries no privacy cost, so
plain shuffled mini-batches and AdamW are fine here. With `model.name` set,
that model is loaded and saved as is (no pretraining).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, DataError
from ..io import flat_lists, read_table
from ..logutil import Progress
from ..seeding import derive_seed
from .models import build_model, load_model, load_tokenizer, save_model_atomic, special_ids

log = logging.getLogger(__name__)


def _load_public(path: str | Path, sequence_length: int) -> list[np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist; run the data stage for the public dataset first.")
    table = read_table(path, columns=["input_ids"])
    if table.num_rows == 0:
        raise DataError(f"{path} has no rows; the public corpus is empty.")
    values, offsets = flat_lists(table["input_ids"], np.int64)
    lengths = np.diff(offsets)
    return [values[offsets[i]:offsets[i] + min(lengths[i], sequence_length)] for i in range(len(lengths)) if lengths[i] >= 2]


def pretrain(config: dict, tokenizer_dir: str | Path, public_tokens: str | Path | None, out_dir: str | Path) -> dict[str, Any]:
    """Build (or load) the base model, pretrain it on public tokens, save it atomically to `out_dir`."""
    mcfg = config["model"]
    tok = load_tokenizer(tokenizer_dir)
    L = int(config["tokenizer"]["sequence_length"])
    if mcfg.get("name"):
        model = load_model(mcfg["name"])
        save_model_atomic(model, out_dir)
        log.info("saved %s as the base model (no pretraining: model.name is set)", mcfg["name"])
        return {"model": mcfg["name"], "steps": 0}

    ids = special_ids(tok)
    model = build_model(mcfg, len(tok), L, ids, seed=derive_seed(config["seed"], "model_init"))
    pcfg = mcfg["pretrain"]
    steps, bs, lr = int(pcfg["steps"]), int(pcfg["batch_size"]), float(pcfg["learning_rate"])
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built %s: %d layers, width %d, %d parameters, vocab %d", mcfg["architecture"], mcfg["n_layer"],
             mcfg["n_embd"], n_params, len(tok))
    losses: list[float] = []
    if steps > 0:
        if public_tokens is None:
            raise ConfigError("model.pretrain.steps > 0 but there is no public corpus to pretrain on.")
        seqs = _load_public(public_tokens, L)
        if not seqs:
            raise DataError(f"{public_tokens} has no sequence of at least 2 tokens to pretrain on.")
        rng = np.random.default_rng(derive_seed(config["seed"], "pretrain_batches"))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        warm = max(1, steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        pad = ids["pad_token_id"]
        model.train()
        progress = Progress(log, steps, f"pretrain steps (batch {bs})")
        for step in range(1, steps + 1):
            batch = rng.integers(0, len(seqs), size=bs)
            inp = torch.full((bs, L), pad, dtype=torch.long)
            mask = torch.zeros((bs, L), dtype=torch.long)
            for j, i in enumerate(batch):
                s = seqs[i]
                inp[j, : len(s)] = torch.from_numpy(s)
                mask[j, : len(s)] = 1
            labels = inp.masked_fill(mask == 0, -100)
            out = model(input_ids=inp, attention_mask=mask, labels=labels)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(out.loss.detach()))
            progress.update(1, lambda: f"loss {float(np.mean(losses[-20:])):.4f}")
    model.eval()
    save_model_atomic(model, out_dir)
    return {"model": mcfg["architecture"], "parameters": n_params, "steps": steps,
            "final_loss": float(np.mean(losses[-20:])) if losses else None}
