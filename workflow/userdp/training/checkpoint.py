"""Atomic training checkpoints inside the run directory.

One file, `{run_dir}/checkpoint/state.pt`, holds everything a resumed run
needs to continue exactly where it stopped: model, optimizer and scheduler
state, the step counter, the sampler's and the noise generator's RNG states,
torch's global RNG, the realised-compute counters and the per-step log so
far. It is written to a temporary file and renamed into place, so a job
killed while saving leaves the previous checkpoint intact.

A fingerprint of the mechanism and training settings is stored with it; a
checkpoint whose fingerprint differs (the plan or config changed) is ignored
and training starts afresh, rather than silently mixing two mechanisms.
The checkpoint is deleted once the run's final outputs are written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..io import atomic_path

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "state.pt"


def fingerprint(obj: Any) -> str:
    """SHA-256 of a JSON-serialisable description of the run."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (names, dtypes, shapes, bytes).

    Part of a run's fingerprint: a checkpoint made from another base model
    (e.g. the pretrained model was rebuilt after an interruption) must not be
    resumed.
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().reshape(-1).contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def arrays_digest(*arrays: np.ndarray) -> str:
    """SHA-256 of numpy arrays (dtype, shape, bytes): the content of a training pool."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}|{a.shape}|".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def save_checkpoint(ckpt_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write `state` atomically to `ckpt_dir/state.pt`."""
    path = Path(ckpt_dir) / CHECKPOINT_FILE
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path


def load_checkpoint(ckpt_dir: str | os.PathLike, expected_fingerprint: str) -> dict[str, Any] | None:
    """The saved state if a checkpoint with a matching fingerprint exists, else None."""
    path = Path(ckpt_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != expected_fingerprint:
        log.warning("ignoring checkpoint %s: it belongs to a different plan or training config", path)
        return None
    return state


def remove_checkpoint(ckpt_dir: str | os.PathLike) -> None:
    """Delete the checkpoint folder (after the run's outputs are complete)."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)
