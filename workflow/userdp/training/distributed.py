"""Data-parallel DP-SGD for one run over several processes (torchrun), same mechanism as one process.

Design (explicit all-reduce, not DDP's hooks: ClippedGradients already
produces summed clipped gradients, which is exactly what must be reduced):

- Sampling needs no communication. Every rank runs the same seeded
  PoissonSampler (keyed per-unit draws, and for ULS with
  `uls_examples_per_user` the same keyed per-user row subsets), so every
  rank draws the same units each step. The step's micro-batches are packed identically on every
  rank and micro-batch i is processed by rank i % world_size.
- Each rank adds the clipped per-unit gradients of its micro-batches into
  p.grad; a unit never straddles micro-batches, so it is clipped whole by
  one rank and the sensitivity of the sum stays C.
- Noise is added exactly once: rank 0 adds N(0, (sigma C)^2) to its partial
  sum BEFORE the all-reduce; the other ranks add none. The SUM all-reduce
  then gives every rank the same noisy sum (sum of all clipped gradients +
  one noise draw, std sigma * C), so replicas stay identical without relying
  on identical random streams on several devices, and only one rank spends
  time drawing noise. Rank 0's noise generator is seeded and checkpointed as
  in a single-process run, so the mechanism, the noise values and the ledger
  are those of the single-process run with the same seed.
- Every rank then divides by the expected batch size and takes the same
  optimizer step on the same gradient, so parameters stay identical.
  Only the floating-point summation order differs from one process (partial
  sums per rank, then the all-reduce), which changes the last bits; this is
  not a change of mechanism.
- Rank 0 alone writes checkpoints, the model, train_log and ledger. Sampler,
  noise and optimizer states are global (identical on every rank), so a
  checkpoint resumes with any number of processes, one included.

Launch: `launch_torchrun` starts `python -m torch.distributed.run
--standalone --nproc_per_node N -m <module> <args>` (a free rendezvous port
on this node, so concurrent jobs never collide); each worker calls
`init_from_env`. Device per rank: cuda:{LOCAL_RANK} with NCCL when the run
is on CUDA, else CPU with gloo (for tests and CPU-only machines).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Sequence, TypeVar

import torch
import torch.distributed as torch_dist

from ..errors import ConfigError
from .models import resolve_device

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the data-parallel group of one run."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 adds the noise and writes every file of the run."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process: gradients and statistics need reducing."""
        return self.world_size > 1


def current_context() -> DistContext | None:
    """The context of an initialised torch.distributed process group, else None."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    local = int(os.environ.get("LOCAL_RANK", torch_dist.get_rank()))
    return DistContext(torch_dist.get_rank(), torch_dist.get_world_size(), local)


def rank_device(setting: str, ctx: DistContext | None) -> torch.device:
    """training.device resolved for this rank: cuda:{local_rank} on CUDA, else the device itself."""
    device = resolve_device(setting)
    if ctx is None or not ctx.active or device.type != "cuda":
        return device
    if ctx.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"process {ctx.rank} of {ctx.world_size} needs GPU {ctx.local_rank} but only "
            f"{torch.cuda.device_count()} are visible; set training.gpus (or the profile's finetune gpu resource) "
            "to at most the number of GPUs of the node."
        )
    device = torch.device("cuda", ctx.local_rank)
    torch.cuda.set_device(device)
    return device


def init_from_env(device_setting: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    Backend: NCCL when training runs on CUDA, gloo otherwise.
    """
    if torch_dist.is_initialized():
        ctx = current_context()
        assert ctx is not None
        return ctx
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if world <= 1:
        return DistContext(0, 1, 0)
    backend = "nccl" if resolve_device(device_setting).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    torch_dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world, local)


def shutdown() -> None:
    """Leave the process group (if any)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def my_share(items: Sequence[T], ctx: DistContext | None) -> list[T]:
    """This rank's micro-batches: item i goes to rank i % world_size (all items with one process)."""
    if ctx is None or not ctx.active:
        return list(items)
    return list(items[ctx.rank::ctx.world_size])


def all_reduce_grads_of(tensors: Iterable[torch.Tensor], ctx: DistContext | None) -> None:
    """Sum tensors over ranks in place, through one flat buffer per dtype (one collective, not one per tensor)."""
    if ctx is None or not ctx.active:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch_dist.all_reduce(flat, op=torch_dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def all_reduce_sums(values: Sequence[float], ctx: DistContext | None, device: torch.device) -> list[float]:
    """Sum a few per-rank float statistics (losses, counts) over ranks."""
    if ctx is None or not ctx.active:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return [float(v) for v in t.cpu()]


def broadcast_object(obj: Any, ctx: DistContext | None, device: torch.device) -> Any:
    """Rank 0's `obj` on every rank (also a barrier: no rank returns before rank 0 got here)."""
    if ctx is None or not ctx.active:
        return obj
    box = [obj if ctx.is_main else None]
    torch_dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def check_replicas(params: Sequence[torch.nn.Parameter], ctx: DistContext | None, device: torch.device) -> None:
    """Raise if the ranks' parameters differ (they must be bitwise identical).

    Cheap: every rank contributes a float64 (sum, sum of squares, weighted sum)
    fingerprint of its parameters. Replicas can only drift if a collective
    returned different values on different ranks; the checkpoint written just
    before holds rank 0's state, so a rerun resumes consistently.
    """
    if ctx is None or not ctx.active:
        return
    with torch.no_grad():
        fp = torch.zeros(3, dtype=torch.float64, device=device)
        for i, p in enumerate(params):
            x = p.detach().double().reshape(-1)
            fp[0] += x.sum()
            fp[1] += x.square().sum()
            fp[2] += (i + 1) * x[:: max(1, x.numel() // 64)].sum()
    gathered = [torch.zeros_like(fp) for _ in range(ctx.world_size)]
    torch_dist.all_gather(gathered, fp)
    if any(not torch.equal(g, gathered[0]) for g in gathered[1:]):
        raise RuntimeError(
            "data-parallel replicas diverged: the parameters differ between processes "
            f"({[g.tolist() for g in gathered]}); rerun the job to resume from rank 0's last checkpoint."
        )


def torchrun_command(nprocs: int, module: str, args: Sequence[str]) -> list[str]:
    """The command that runs `python -m module args` in `nprocs` processes on this node."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc_per_node", str(int(nprocs)), "-m", module, *map(str, args),
    ]


def launch_torchrun(nprocs: int, module: str, args: Sequence[str], threads_per_process: int = 1) -> None:
    """Run `module` under torchrun with `nprocs` processes and wait; raise if any process failed."""
    cmd = torchrun_command(nprocs, module, args)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, int(threads_per_process))))
    log.info("launching %d data-parallel processes: %s", nprocs, " ".join(cmd))
    res = subprocess.run(cmd, env=env)
    if res.returncode != 0:
        raise RuntimeError(
            f"{nprocs} data-parallel training processes failed (torchrun exit status {res.returncode}); "
            "their messages are in this log and in the job's stderr."
        )
