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

The checkpoint holds the noise generator's and the sampler's states: with
secret seeds (privacy.secret_seeds) the only copy of the secret, from which
the noise of the released model could be regenerated and subtracted. So:

- the folder is 0700 and state.pt 0600, whatever the umask;
- it is loaded with `torch.load(weights_only=True)`: it holds only tensors
  and plain Python values (the RNG states are dicts of ints and byte
  tensors), so no allow-list is needed, and a file holding any other object
  (one whose unpickling could run code) is refused with a DataError;
- it is deleted once the run's final outputs are written, and a deletion
  that fails raises a DataError naming the folder instead of leaving the
  secret behind silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from ..io import atomic_path

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "state.pt"
DIR_MODE, FILE_MODE = 0o700, 0o600


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


def save_checkpoint(ckpt_dir: str | os.PathLike, state: dict[str, Any], name: str = CHECKPOINT_FILE) -> Path:
    """Write `state` atomically to `ckpt_dir/name` (default state.pt; folder 0700, file 0600).

    `state` must hold only tensors and plain Python values (what
    `load_checkpoint` accepts).
    """
    folder = Path(ckpt_dir)
    folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(folder, DIR_MODE)  # mkdir's mode is masked by the umask, and the folder may predate this
    path = folder / name
    with atomic_path(path, mode=FILE_MODE) as tmp:  # the temporary file is 0600 too (mkstemp)
        torch.save(state, tmp)
    return path


def load_checkpoint(ckpt_dir: str | os.PathLike, expected_fingerprint: str) -> dict[str, Any] | None:
    """The saved state if a checkpoint with a matching fingerprint exists, else None."""
    path = Path(ckpt_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[-1][:300]
        raise DataError(
            f"checkpoint {path} holds objects other than tensors and plain values ({reason}); userdp does not "
            f"write such checkpoints and loading it could run arbitrary code, so it is refused. Delete the folder "
            f"{Path(ckpt_dir)} to restart this run from step 0."
        ) from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise DataError(f"checkpoint {path} cannot be read ({str(exc).strip() or type(exc).__name__}): it is "
                        f"damaged, e.g. empty or cut off; delete the folder {Path(ckpt_dir)} to restart "
                        "this run from step 0.") from None
    if not isinstance(state, dict):
        raise DataError(f"checkpoint {path} holds a {type(state).__name__}, not a training state; delete the "
                        f"folder {Path(ckpt_dir)} to restart this run from step 0.")
    if state.get("fingerprint") != expected_fingerprint:
        log.warning("ignoring checkpoint %s: it belongs to a different plan or training config", path)
        return None
    return state


def remove_checkpoint(ckpt_dir: str | os.PathLike) -> None:
    """Delete the checkpoint folder (after the run's outputs are complete); DataError if it cannot be deleted.

    A folder that does not exist (no checkpoint was written) is fine.
    """
    folder = Path(ckpt_dir)
    if not os.path.lexists(folder):
        return
    try:
        shutil.rmtree(folder)  # raises on any failure, also for a symbolic link or a file in its place
    except OSError as exc:
        raise DataError(
            f"could not delete the checkpoint folder {folder} after the run's outputs were written ({exc}). It "
            "holds the sampler's and the noise generator's states (with secret seeds the only copy of the secret "
            f"noise seeds), so it must not stay behind: fix the cause, delete {folder} by hand and rerun the job."
        ) from exc
