"""The DP-SGD training loop (ELS and ULS), with checkpoint/resume and a privacy ledger.

One step, for both methods (method.md sections 3 and 4):

1. Poisson-sample units: examples of the bounded pool (ELS, rate q) or
   train users (ULS, rate q_u). The realised size varies; that is correct.
2. Pack the units' rows into fixed-shape micro-batches; add the clipped
   per-unit gradients of every micro-batch into p.grad (ClippedGradients).
3. Add N(0, (sigma C)^2) noise once to every coordinate of the sum.
4. Divide by the EXPECTED number of units, q * N (a public constant),
   never by the realised count, which would leak it.
5. Optimizer and LR-schedule step.

Non-private reference cells (eps = inf: sigma 0, clip norm null) run the
same sampling and division, with no clipping and no noise.

Every `checkpoint_every` steps the full state is saved atomically in the
run's `checkpoint/` folder; a restarted job resumes from it, so the total
number of noisy steps a released model has seen is exactly T. When the run
completes, the model, train_log.parquet and ledger.json are written and the
checkpoint is deleted.

Several processes (torchrun; `userdp.training.distributed`): when
torch.distributed is initialised (or `dist` is passed), every rank draws the
same sample, processes its share of the micro-batches, rank 0 adds the noise
and the gradients are summed over ranks before the division; the mechanism,
parameters and ledger are those of a one-process run with the same seeds.
Rank 0 alone writes files.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch

from ..config import fmt_num
from ..errors import DataError
from ..io import write_json, write_parquet
from . import checkpoint as ckpt
from . import distributed
from .batching import check_uls_fits, pack_micro_batches, select_els, select_uls
from .ledger import build_ledger
from .models import autocast_context, resolve_device, save_model_atomic
from .noise import GaussianNoise
from .optim import make_optimizer, make_scheduler
from .pool import TrainingPool
from .sampling import PoissonSampler, derive_seed

log = logging.getLogger(__name__)

LOG_COLUMNS = [
    "step", "loss", "realised_examples", "realised_users", "realised_units", "examples_processed",
    "learning_rate", "clipped_fraction", "mean_unit_norm", "seconds",
]


@dataclass
class TrainSettings:
    """The training.* settings of one run (plus the swept learning rate)."""

    learning_rate: float
    optimizer: str = "adam"
    schedule: str = "constant"
    warmup_steps: int = 0
    physical_batch_size: int = 64
    sequence_length: int = 64
    checkpoint_every: int = 25
    device: str = "auto"
    precision: str = "fp32"
    uls_examples_per_user: int | None = None
    log_every_s: float = 10.0

    @classmethod
    def from_config(cls, config: dict, learning_rate: float) -> "TrainSettings":
        tr = config["training"]
        return cls(
            learning_rate=float(learning_rate),
            optimizer=tr["optimizer"],
            schedule=tr["schedule"],
            warmup_steps=int(tr["warmup_steps"]),
            physical_batch_size=int(tr["physical_batch_size"]),
            sequence_length=int(config["tokenizer"]["sequence_length"]),
            checkpoint_every=int(tr["checkpoint_every"]),
            device=tr["device"],
            precision=tr["precision"],
            uls_examples_per_user=tr.get("uls_examples_per_user"),
        )


@dataclass
class RunPaths:
    """Where a run writes: ledger, per-step log, final model, checkpoint."""

    run_dir: Path
    ledger: Path = field(init=False)
    train_log: Path = field(init=False)
    model_dir: Path = field(init=False)
    checkpoint_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.ledger = self.run_dir / "ledger.json"
        self.train_log = self.run_dir / "train_log.parquet"
        self.model_dir = self.run_dir / "model"
        self.checkpoint_dir = self.run_dir / "checkpoint"


@dataclass
class TrainOutcome:
    complete: bool
    steps_completed: int
    ledger: dict[str, Any] | None
    log: pd.DataFrame


def run_seeds(config_seed: int, run_seed: int, dataset: str, method: str, eps: str, budget: int | str,
              group_size: int, learning_rate: float | None = None, secret: bool = False) -> dict[str, Any]:
    """Seeds of a run, derived from the config seed, the cell and its learning rate.

    The learning rate IS part of the seeds: runs of a learning-rate sweep that
    shared their batches and noise would let the noise cancel between two
    released models (with SGD, (theta0 - theta_a)/lr_a - (theta0 - theta_b)/lr_b
    is a noise-free sum of clipped gradients), so every rate draws its own
    Poisson samples and its own noise, and the k runs of a sweep compose as k
    independent mechanisms (see evaluation.select).

    secret: the sampler and noise seeds are replaced by fresh OS entropy when
    training starts (`privacy.secret_seeds`): with seeds derived from the
    config, anyone who has the config can regenerate the Poisson samples and
    the noise of a released model, which voids the guarantee.
    """
    cell = (int(config_seed), dataset, method, eps, int(budget), int(group_size), int(run_seed))
    if learning_rate is not None:
        cell = cell + (fmt_num(float(learning_rate)),)
    return {
        "config": int(config_seed),
        "run": int(run_seed),
        "sampler": derive_seed(*cell, "sampler"),
        "noise": derive_seed(*cell, "noise"),
        "torch": derive_seed(*cell, "torch"),
        "secret": bool(secret),
    }


SECRET_SEEDS = ("sampler", "noise")


def draw_secret_seeds(seeds: dict[str, Any], dist: distributed.DistContext | None,
                      device: torch.device) -> dict[str, Any]:
    """`seeds` with the sampler and noise seeds drawn from OS entropy (rank 0's, sent to every rank).

    Every rank must draw the same Poisson sample, so rank 0 draws and broadcasts.
    """
    fresh = {k: secrets.randbits(63) for k in SECRET_SEEDS} if dist is None or dist.is_main else None
    fresh = distributed.broadcast_object(fresh, dist, device)
    return {**seeds, **fresh}


def public_seeds(seeds: dict[str, Any]) -> dict[str, Any]:
    """The seeds as written to the ledger and the checkpoint fingerprint: secret ones masked."""
    if not seeds.get("secret"):
        return dict(seeds)
    return {k: ("secret" if k in SECRET_SEEDS else v) for k, v in seeds.items()}


def _default_gradient_source() -> Callable[..., Any]:
    from .clipping import ClippedGradients

    return ClippedGradients


def _unit_norm_sum(norms: Any) -> tuple[float, int]:
    if norms is None:
        return 0.0, 0
    t = torch.as_tensor(norms).detach().float().reshape(-1)
    return float(t.sum()), int(t.numel())


def train(
    model: torch.nn.Module,
    pool: TrainingPool,
    plan: dict[str, Any],
    settings: TrainSettings,
    paths: RunPaths,
    seeds: dict[str, int],
    pad_id: int,
    *,
    gradient_source: Callable[..., Any] | None = None,
    compute_epsilon: Callable[..., float] | None = None,
    max_steps: int | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    dist: distributed.DistContext | None = None,
) -> TrainOutcome:
    """Run (or resume) DP fine-tuning of `model` on `pool` with the mechanism in `plan`.

    gradient_source: a factory `(model, clip_norm, normalize=...)` returning an
    object with `accumulate(input_ids, attention_mask, unit_ids, row_weights)`
    (default: userdp.training.clipping.ClippedGradients).
    max_steps: stop after this many steps in this invocation (checkpointing
    first); the run then reports complete=False and writes no final outputs.
    on_step: called after every step with (step, log row); an exception in it
    interrupts the run like a crash would.
    dist: this process's rank in a data-parallel group (default: taken from an
    initialised torch.distributed process group; None = one process).
    """
    method = plan["method"]
    T = int(plan["steps"])
    G = int(plan["group_size"])
    q = float(plan["sampling_rate"])
    sigma = float(plan.get("noise_multiplier") or 0.0)
    clip_norm = plan.get("clip_norm")
    clip_norm = None if clip_norm is None else float(clip_norm)
    if clip_norm is None and sigma > 0:
        raise DataError(f"plan for this run has noise_multiplier {sigma} but no clip_norm; rebuild the plan.")
    if pool.group_size != G:
        raise DataError(f"the training pool was bounded with G = {pool.group_size} but the plan says group_size {G}.")
    if method == "uls":
        check_uls_fits(G, settings.physical_batch_size, settings.uls_examples_per_user)
    elif method != "els":
        raise DataError(f"plan method is {method!r}; expected 'els' or 'uls'.")

    if dist is None:
        dist = distributed.current_context()
    is_main = dist is None or dist.is_main
    device = distributed.rank_device(settings.device, dist) if dist is not None else resolve_device(settings.device)
    model.to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    n_units = pool.n_examples if method == "els" else pool.n_users
    if seeds.get("secret"):
        # Fresh entropy at every start; a resumed run restores the sampler's and
        # the noise's RNG states from its checkpoint below, so it continues the
        # same secret streams. Only the checkpoint (deleted at the end) holds them.
        seeds = draw_secret_seeds(seeds, dist, device)
    sampler = PoissonSampler(n_units, q, seeds["sampler"])
    expected = sampler.expected_size
    if expected <= 0:
        raise DataError(f"expected batch size q * N = {q} * {n_units} is 0; the plan does not fit this pool.")
    planned = plan.get("expected_batch")
    if planned is not None and abs(float(planned) - expected) > 1e-3 * max(expected, 1.0):
        log.warning(
            "plan expected_batch %.6g differs from q * N = %.6g on this pool (N = %d %s); dividing by q * N, "
            "the expectation of the realised size under this sampler.",
            float(planned), expected, n_units, "examples" if method == "els" else "users",
        )
    noise = GaussianNoise(sigma, clip_norm, seeds["noise"], device)
    factory = gradient_source or _default_gradient_source()
    grads = factory(model, clip_norm, normalize=(plan.get("clipping") == "normalized"))
    optimizer = make_optimizer(params, settings.optimizer, settings.learning_rate)
    scheduler = make_scheduler(optimizer, settings.schedule, settings.warmup_steps, T)

    fp = ckpt.fingerprint({
        "plan": {k: plan.get(k) for k in ("method", "sampling_rate", "noise_multiplier", "clip_norm", "clipping",
                                         "group_size", "steps", "delta")},
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("device", "log_every_s")},
        "seeds": public_seeds(seeds), "n_units": n_units, "n_pool_examples": pool.n_examples,
        # content, not only sizes: a rebuilt base model or training data must not resume an old run
        "model": ckpt.model_digest(model),
        "pool": ckpt.arrays_digest(pool.user_offsets, pool.example_ids, pool.token_offsets, pool.token_values),
    })
    step, examples_processed, users_processed = 0, 0, 0
    rows: list[dict[str, Any]] = []
    resumed_at: list[int] = []
    state = ckpt.load_checkpoint(paths.checkpoint_dir, fp)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        noise.load_state_dict(state["noise"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])  # dropout of loaded models on CUDA
        step = int(state["step"])
        examples_processed = int(state["examples_processed"])
        users_processed = int(state["users_processed"])
        rows = list(state["log"])
        resumed_at = list(state["resumed_at"]) + [step]
        log.info("resumed from checkpoint at step %d/%d (%s)", step, T, paths.checkpoint_dir)
    else:
        torch.manual_seed(seeds["torch"])

    def save() -> None:
        if not is_main:  # every rank holds the same state; rank 0 writes it
            return
        ckpt.save_checkpoint(paths.checkpoint_dir, {
            "fingerprint": fp, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(), "noise": noise.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "examples_processed": examples_processed,
            "users_processed": users_processed, "log": rows, "resumed_at": resumed_at,
        })

    world = dist.world_size if dist is not None else 1
    log.info(
        "training %s: T=%d q=%.6g expected %s=%.2f sigma=%.4g C=%s G=%d pool=%d examples/%d users lr=%g device=%s"
        " processes=%d",
        method, T, q, "examples" if method == "els" else "users", expected, sigma, clip_norm, G,
        pool.n_examples, pool.n_users, settings.learning_rate, device, world,
    )
    start = time.monotonic()
    last_log = start - settings.log_every_s
    done_now, saved_at = 0, step
    autocast = autocast_context(device, settings.precision)
    while step < T and (max_steps is None or done_now < max_steps):
        t0 = time.monotonic()
        sampled = sampler.sample()
        if method == "els":
            sel = select_els(pool, sampled)
        else:
            sel = select_uls(pool, sampled, settings.uls_examples_per_user, sampler.rng)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        loss_sum, n_rows, n_units_seen, clipped, norm_sum, norm_n = 0.0, 0, 0, 0.0, 0.0, 0
        micro_batches = pack_micro_batches(pool, sel, settings.physical_batch_size, settings.sequence_length, pad_id)
        # With several processes every rank packed the same micro-batches; it processes its share.
        for mb in distributed.my_share(micro_batches, dist):
            with autocast:
                stats = grads.accumulate(
                    mb.input_ids.to(device), mb.attention_mask.to(device), mb.unit_ids.to(device),
                    mb.row_weights.to(device),
                )
            loss_sum += float(stats["loss_sum"])
            n_rows += int(stats["n_rows"])
            k = int(stats["n_units"])
            n_units_seen += k
            clipped += float(stats.get("clipped_fraction") or 0.0) * k
            s, n = _unit_norm_sum(stats.get("unit_norms"))
            norm_sum, norm_n = norm_sum + s, norm_n + n
        if is_main:
            # Noise once per step: with several processes rank 0 adds it to its partial sum
            # and the all-reduce below hands every rank the same noisy total.
            noise.add_(params)
        if dist is not None and dist.active:
            distributed.all_reduce_grads(params, dist)
            loss_sum, n_rows, n_units_seen, clipped, norm_sum, norm_n = distributed.all_reduce_sums(
                [loss_sum, n_rows, n_units_seen, clipped, norm_sum, norm_n], dist, device)
            n_rows, n_units_seen, norm_n = int(n_rows), int(n_units_seen), int(norm_n)
        for p in params:
            p.grad.div_(expected)
        lr = float(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        step += 1
        done_now += 1
        examples_processed += sel.n_examples
        users_processed += sel.n_users
        row = {
            "step": step,
            "loss": loss_sum / n_rows if n_rows else math.nan,
            "realised_examples": sel.n_examples,
            "realised_users": sel.n_users,
            "realised_units": sel.n_units,
            "examples_processed": examples_processed,
            "learning_rate": lr,
            "clipped_fraction": clipped / n_units_seen if n_units_seen and clip_norm is not None else math.nan,
            "mean_unit_norm": norm_sum / norm_n if norm_n else math.nan,
            "seconds": time.monotonic() - t0,
        }
        rows.append(row)
        if on_step is not None:
            on_step(step, row)
        if step % settings.checkpoint_every == 0 and step < T:
            save()
            saved_at = step
            distributed.check_replicas(params, dist, device)
        now = time.monotonic()
        if now - last_log >= settings.log_every_s or step == T:
            last_log = now
            elapsed = now - start
            ex_rate = sum(r["realised_examples"] for r in rows[-done_now:]) / max(elapsed, 1e-9)
            eta = (T - step) * elapsed / done_now
            log.info("step %d/%d loss %.4f examples/s %.1f ETA %.0fs", step, T, row["loss"], ex_rate, eta)

    frame = pd.DataFrame(rows, columns=LOG_COLUMNS)
    if step < T:
        if saved_at != step:
            save()
        distributed.broadcast_object(None, dist, device)  # no rank returns before the checkpoint is written
        log.info("stopped at step %d/%d; checkpoint saved, rerun to resume", step, T)
        return TrainOutcome(False, step, None, frame)
    distributed.check_replicas(params, dist, device)
    if not is_main:
        # Rank 0 writes the outputs; the broadcast returns once they are complete.
        ledger = distributed.broadcast_object(None, dist, device)
        return TrainOutcome(True, step, ledger, frame)

    ledger = build_ledger(
        plan, steps_completed=step, expected_batch=expected, n_train_users=pool.n_users,
        n_pool_examples=pool.n_examples, examples_processed=examples_processed, users_processed=users_processed,
        learning_rate=settings.learning_rate, training=asdict(settings), seeds=public_seeds(seeds), resumed_at=resumed_at,
        compute_epsilon=compute_epsilon,
    )
    ledger["n_examples_before_bounding"] = pool.n_examples_before_bounding
    ledger["device"] = str(device)
    ledger["precision"] = settings.precision if device.type == "cuda" else "fp32"
    ledger["processes"] = world
    save_model_atomic(model, paths.model_dir)
    write_parquet(paths.train_log, frame)
    write_json(paths.ledger, ledger)
    # Outputs are complete; the checkpoint is no longer needed (it can be as
    # large as model + optimizer state).
    ckpt.remove_checkpoint(paths.checkpoint_dir)
    distributed.broadcast_object(ledger, dist, device)
    log.info("run complete: %d steps, epsilon %.4g, realised compute %d examples (%.3f of budget)",
             step, ledger["epsilon"], examples_processed, ledger["compute_ratio"] or math.nan)
    return TrainOutcome(True, step, ledger, frame)
