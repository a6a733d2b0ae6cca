"""The DP-SGD training loop (ELS and ULS), with checkpoint/resume and a privacy ledger.

One step, for both methods (docs/method.md sections 3 and 4), in the order of
Opacus' DPOptimizer.pre_step (`DPStep`):

1. `sample`: Poisson-sample units: examples of the bounded pool (ELS, rate q)
   or train users (ULS, rate q_u). The realised size varies; that is correct.
   Draws are keyed per unit identity (sampling.py), so removing a user
   changes no other unit's draws; `train(observe=...)` exposes each step's
   units, clipped sum and noise to check exactly that
   (tests/test_replay_neighbouring.py).
2. `clipped_sum`: pack the units' rows into fixed-shape micro-batches; add the
   clipped per-unit gradients of every micro-batch into p.grad
   (ClippedGradients).
3. `privatize`: add N(0, (sigma C)^2) noise once to every coordinate of the
   sum, then divide by the EXPECTED number of units, q * N (a public
   constant), never by the realised count, which would leak it.
4. Optimizer and LR-schedule step.

Non-private reference cells (eps = inf: sigma 0, clip norm null) run the
same sampling and division, with no clipping and no noise.

`RunState` owns the state of every component (model, optimizer, scheduler,
sampler, noise generator, torch/CUDA RNG, counters, log rows); every
`checkpoint_every` steps it is saved atomically in the run's `checkpoint/`
folder, and also when the job gets SIGTERM (after the step in progress; `train`
then raises `errors.Preempted` and the job exits with 143); a restarted job
resumes from it, so the total number of noisy steps a released model has seen
is exactly T. When the run completes, the model, train_log.parquet and
ledger.json are written and the checkpoint is deleted.

`train` reads top to bottom as the run's phases: `prepare` (placement, secret
seeds, state, step, keys) -> `restore_finished` (a run finished before: its
outputs linked back) or `resume_or_start` (its checkpoint) -> `loop` ->
`finish` (model, log, ledger) or `interrupt` (checkpoint saved). The
mechanism comes from a `privacy.spec.RunSpec` (the plan); observation for
tests and audits goes through a `StepHook` of `DPStep` (`Observer`).

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
import signal
import threading
import time
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

from ..errors import DataError, Preempted
from ..io import read_frame, read_json, write_json, write_parquet
from ..layout import LEDGER, RUN_MODEL, TRAIN_LOG, fmt_num
from ..privacy import mechanism as privacy_mechanism
from ..privacy.spec import RunSpec
from ..seeding import derive_seed
from . import checkpoint as ckpt
from . import distributed, finished, model_card, step_log
from .batching import StepSelection, check_uls_fits, pack_micro_batches, select_els, select_uls
from .gradients import GradientSource, GradientSourceFactory, MicroBatchStats
from .ledger import RunFacts, build_ledger
from .models import autocast_context, resolve_device, save_model_atomic
from .noise import GaussianNoise
from .optim import AdamBC, make_optimizer, make_scheduler
from .pool import TrainingPool
from .sampling import PoissonSampler
from .settings import TrainSettings

log = logging.getLogger(__name__)

# The per-step log's columns, and which of them leave the run (training.debug_step_log): step_log.
LOG_COLUMNS = step_log.LOG_COLUMNS
# The plan keys that define the mechanism a checkpoint belongs to.
FINGERPRINT_PLAN_KEYS = ("method", "sampling_rate", "noise_multiplier", "clip_norm", "clipping", "group_size",
                         "steps", "delta")


@dataclass
class RunPaths:
    """Where a run writes: ledger, per-step log, final model, checkpoint."""

    run_dir: Path
    log: Path | None = None  # the job's log file (kept in the finished record, see userdp.training.finished)
    ledger: Path = field(init=False)
    train_log: Path = field(init=False)
    model_dir: Path = field(init=False)
    checkpoint_dir: Path = field(init=False)
    card: Path = field(init=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.log = None if self.log is None else Path(self.log)
        self.ledger = self.run_dir / LEDGER
        self.train_log = self.run_dir / TRAIN_LOG
        self.model_dir = self.run_dir / RUN_MODEL
        self.checkpoint_dir = self.run_dir / "checkpoint"
        self.card = self.run_dir / model_card.CARD


@dataclass
class TrainOutcome:
    complete: bool
    steps_completed: int
    ledger: dict[str, Any] | None
    log: pd.DataFrame


def run_seeds(config_seed: int, run_seed: int, dataset: str, method: str, eps: str, budget: int | str,
              group_size: int, learning_rate: float | None = None, secret: bool = False,
              trial: int | None = None) -> dict[str, Any]:
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

    trial: the run's index among a random-stopping cell's runs
    (privacy.selection.accounting: random_stopping), which may draw the same
    learning rate twice; each run is an independent mechanism, so the index
    is part of its seeds.
    """
    cell = (int(config_seed), dataset, method, eps, int(budget), int(group_size), int(run_seed))
    if learning_rate is not None:
        cell = cell + (fmt_num(float(learning_rate)),)
    if trial is not None:
        cell = cell + ("trial", int(trial))
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


def run_fingerprint(spec: RunSpec, settings: TrainSettings, device: torch.device, seeds: dict[str, Any],
                    pool: TrainingPool, model: torch.nn.Module, n_units: int) -> str:
    """What a checkpoint must match to be resumed: the mechanism, the result-changing settings
    (TrainSettings.result_settings, with the device type the run uses), the public seeds, and the
    content of the base model and the pool (a rebuilt model or training data must not resume an old run).
    """
    return ckpt.fingerprint({
        "plan": {k: getattr(spec, k) for k in FINGERPRINT_PLAN_KEYS},
        "settings": settings.result_settings(device=device.type),
        "seeds": public_seeds(seeds), "n_units": n_units, "n_pool_examples": pool.n_examples,
        "sampler": PoissonSampler.SCHEME,
        "model": ckpt.model_digest(model),
        "pool": ckpt.arrays_digest(*pool.content_arrays()),
    })


@dataclass(frozen=True)
class RunMechanism:
    """The spec's mechanism (`privacy.mechanism`) for one run, with its noise and clipping, checked against the pool."""

    mechanism: privacy_mechanism.Mechanism  # method, q, T, G
    sigma: float           # noise multiplier (0: no noise)
    clip_norm: float | None  # None: non-private reference (no clipping)
    normalize: bool        # normalized clipping C g / ||g||

    @classmethod
    def of(cls, spec: RunSpec, pool: TrainingPool, settings: TrainSettings) -> "RunMechanism":
        mech = spec.mechanism
        if pool.group_size != mech.group_size:
            raise DataError(f"the training pool was bounded with G = {pool.group_size} but the plan says group_size "
                            f"{mech.group_size}.")
        if mech.unit == "users":
            check_uls_fits(mech.group_size, settings.physical_batch_size, settings.uls_examples_per_user)
        clip_norm = None if spec.clip_norm is None else float(spec.clip_norm)
        return cls(mech, float(spec.noise_multiplier), clip_norm, spec.normalized)

    @property
    def method(self) -> str:
        return self.mechanism.name

    @property
    def steps(self) -> int:
        return int(self.mechanism.steps)

    @property
    def group_size(self) -> int:
        return int(self.mechanism.group_size)

    @property
    def rate(self) -> float:
        return float(self.mechanism.sampling_rate)

    @property
    def unit_name(self) -> str:
        return self.mechanism.unit

    def n_units(self, pool: TrainingPool) -> int:
        """N: the number of units the sampler draws from (bounded examples or train users)."""
        return pool.n_examples if self.unit_name == "examples" else pool.n_users


def divisor_for(spec: RunSpec, mech: RunMechanism, n_units: int, expected: float) -> float:
    """The public constant the noisy sum is divided by (the spec's `divisor_policy`): q * N on this pool, or the
    plan's expected batch when the plan's sizes come from the DP contribution statistics (docs/privacy.md): there
    q * N_G would depend on the exact pool size N_G, which is not public, while the plan's K / T (ELS) or
    q_u * N (ULS) is."""
    if spec.divisor_policy == "planned":
        planned = float(spec.expected_batch)
        if not planned > 0:
            raise DataError(f"plan expected_batch is {planned}; the plan does not fit this pool. Rebuild the plan.")
        return planned  # no comparison with q * N: a message with it would print the exact pool size
    if expected <= 0:
        raise DataError(f"expected batch size q * N = {mech.rate} * {n_units} is 0; the plan does not fit this pool.")
    planned = spec.expected_batch
    if planned is not None and abs(float(planned) - expected) > 1e-3 * max(expected, 1.0):
        log.warning(
            "plan expected_batch %.6g differs from q * N = %.6g on this pool (N = %d %s); dividing by q * N, "
            "the expectation of the realised size under this sampler.",
            float(planned), expected, n_units, mech.unit_name,
        )
    return expected


@dataclass
class StepSums:
    """Statistics of one step, summed over its micro-batches (and over ranks after `privatize`)."""

    loss_sum: float = 0.0
    n_rows: int = 0
    n_units: int = 0
    clipped: float = 0.0   # sum over micro-batches of clipped_fraction * units
    norm_sum: float = 0.0  # sum of the units' pre-clip norms (finite ones)
    norm_n: int = 0
    nonfinite_units: int = 0  # units dropped for a NaN/inf gradient (they contributed zero)

    def add(self, stats: MicroBatchStats) -> None:
        """Add one micro-batch's statistics (a gradient source's `accumulate` result)."""
        self.loss_sum += float(stats.loss_sum)
        self.n_rows += int(stats.n_rows)
        k = int(stats.n_units)
        self.n_units += k
        self.clipped += float(stats.clipped_fraction or 0.0) * k
        self.nonfinite_units += int(stats.nonfinite_units or 0)
        if stats.unit_norms is not None:
            t = torch.as_tensor(stats.unit_norms).detach().float().reshape(-1)
            t = t[torch.isfinite(t)]  # a dropped unit's NaN/inf norm is counted in nonfinite_units instead
            self.norm_sum, self.norm_n = self.norm_sum + float(t.sum()), self.norm_n + int(t.numel())

    def summed_over_ranks(self, dist: distributed.DistContext | None, device: torch.device) -> "StepSums":
        """The totals over every rank of a data-parallel group (self with one process)."""
        if dist is None or not dist.active:
            return self
        total = StepSums(*distributed.all_reduce_sums(list(astuple(self)), dist, device))
        total.n_rows, total.n_units, total.norm_n = int(total.n_rows), int(total.n_units), int(total.norm_n)
        total.nonfinite_units = int(total.nonfinite_units)
        return total


@dataclass
class StepObservation:
    """What one step computed, handed to `train(observe=...)` by the `Observer` step hook.

    The hook for tests and audits of the mechanism (tests/test_replay_neighbouring.py): on D and on D
    minus one user, with the same seeds, every step must sample the same other units, draw the same
    noise and have clipped sums at most k_t C (ELS) or C (ULS) apart.

    step: 1-based. selection: the sampled units (pool rows of every unit, StepSelection; map them to
    users with pool.example_user). clipped_sum: per trainable parameter, the sum over all ranks of the
    clipped per-unit gradients, before noise (an extra all-reduce with several processes, only when
    observing). noise: the noise rank 0 added to it (None on other ranks and when sigma or C is 0).
    nonfinite_units: units dropped for a non-finite gradient.
    """

    step: int
    selection: StepSelection
    clipped_sum: list[torch.Tensor]
    noise: list[torch.Tensor] | None
    nonfinite_units: int


class StepHook:
    """Called by `DPStep` at the points of a step where the mechanism can be observed; this one does nothing.

    before_noise: p.grad holds this rank's clipped sum, before noise. noise_record: a list the noise
    generator appends the noise it adds to (None: record nothing). after_step: the step's update is
    applied (step is 1-based).
    """

    def before_noise(self, params: list[torch.nn.Parameter], dist: distributed.DistContext | None) -> None:
        pass

    def noise_record(self) -> list[torch.Tensor] | None:
        return None

    def after_step(self, step: int, selection: StepSelection, sums: StepSums) -> None:
        pass


class Observer(StepHook):
    """Hands every step's `StepObservation` to `fn` (copies of the clipped sum and the noise)."""

    def __init__(self, fn: Callable[[StepObservation], None]) -> None:
        self.fn = fn
        self._clipped: list[torch.Tensor] = []
        self._noise: list[torch.Tensor] = []

    def before_noise(self, params, dist) -> None:
        self._clipped = [p.grad.detach().clone() for p in params]
        if dist is not None and dist.active:
            distributed.all_reduce_grads_of(self._clipped, dist)

    def noise_record(self) -> list[torch.Tensor]:
        self._noise = []
        return self._noise

    def after_step(self, step, selection, sums) -> None:
        self.fn(StepObservation(step, selection, self._clipped, self._noise or None, sums.nonfinite_units))


def _default_gradient_source() -> GradientSourceFactory:
    from .clipping import ClippedGradients

    return ClippedGradients


class DPStep:
    """One DP-SGD step of the mechanism: `sample` -> `clipped_sum` -> `privatize` (Opacus' pre_step order).

    Leaves the privatised update direction (noisy clipped sum / divisor) in p.grad
    of every trainable parameter; the optimizer step is the caller's.
    """

    def __init__(self, ctx: "RunContext", state: "RunState", grads: GradientSource, divisor: float,
                 hook: StepHook | None = None):
        self.ctx, self.grads, self.hook = ctx, grads, hook or StepHook()
        self.mech, self.pool, self.settings, self.dist = ctx.mech, ctx.pool, ctx.settings, ctx.dist
        self.sampler, self.noise, self.params = state.sampler, state.noise, state.params
        # The divisor, decided once by `divisor_for`: q N, or the plan's public expected batch with DP
        # contribution statistics (no fallback to the pool's exact size here).
        self.expected = float(divisor)
        self.autocast = autocast_context(ctx.device, ctx.settings.precision)

    def sample(self) -> StepSelection:
        """Poisson-sample units; their rows (ULS with uls_examples_per_user: a random k per user)."""
        sampled = self.sampler.sample()
        if self.mech.unit_name == "examples":
            return select_els(self.pool, sampled)
        return select_uls(self.pool, sampled, self.settings.uls_examples_per_user, self.sampler.subset_keys)

    def clipped_sum(self, sel: StepSelection) -> StepSums:
        """p.grad = sum of the clipped per-unit gradients of this rank's share of the micro-batches."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        sums = StepSums()
        s, device = self.settings, self.ctx.device
        micro_batches = pack_micro_batches(self.pool, sel, s.physical_batch_size, s.sequence_length, self.ctx.pad_id)
        # With several processes every rank packed the same micro-batches; it processes its share.
        for mb in distributed.my_share(micro_batches, self.dist):
            with self.autocast:
                sums.add(self.grads.accumulate(mb.input_ids.to(device), mb.attention_mask.to(device),
                                               mb.unit_ids.to(device), mb.row_weights.to(device),
                                               None if mb.loss_mask is None else mb.loss_mask.to(device)))
        return sums

    def privatize(self, sums: StepSums) -> StepSums:
        """Noise once (rank 0), sum over ranks, divide by the expected size q N; the step's total sums."""
        self.hook.before_noise(self.params, self.dist)
        if self.ctx.main:
            # Noise once per step: with several processes rank 0 adds it to its partial sum
            # and the all-reduce below hands every rank the same noisy total.
            self.noise.add_(self.params, record=self.hook.noise_record())
        if self.dist is not None and self.dist.active:
            distributed.all_reduce_grads(self.params, self.dist)
        sums = sums.summed_over_ranks(self.dist, self.ctx.device)
        for p in self.params:
            p.grad.div_(self.expected)
        return sums

    def __call__(self) -> tuple[StepSelection, StepSums]:
        sel = self.sample()
        return sel, self.privatize(self.clipped_sum(sel))

    def update_norms(self) -> tuple[float, float]:
        """(||u||, its noise-corrected estimate) of the privatised update u in p.grad (step_log.signal_norm).

        Post-processing of the step's DP release (u and the public constants sigma C, q N, d): inside the
        guarantee. Every rank holds the same u after `privatize`.
        """
        sq = sum(float(torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2) for p in self.params)
        d = sum(p.numel() for p in self.params)
        return math.sqrt(sq), step_log.signal_norm(sq, d, self.noise.std, self.expected)


class RunState:
    """Everything a run carries from step to step; `state_dict` is what its checkpoint holds."""

    def __init__(self, model: torch.nn.Module, mech: RunMechanism, pool: TrainingPool, settings: TrainSettings,
                 seeds: dict[str, Any], device: torch.device, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, divisor: float = 1.0):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Per-unit keyed draws: removing a user changes no other unit's draws (sampling.py)
        self.sampler = PoissonSampler.for_pool(pool, mech.unit_name, mech.rate, seeds["sampler"])
        self.noise = GaussianNoise(mech.sigma, mech.clip_norm, seeds["noise"], device)
        if optimizer is None:  # the pipeline's: training.optimizer, training.schedule
            self.optimizer = make_optimizer(self.params, settings.optimizer, settings.learning_rate)
            self.scheduler = make_scheduler(self.optimizer, settings.schedule, settings.warmup_steps, mech.steps)
        else:  # the caller's own (userdp.make_private): its scheduler, if any, is stepped with it
            self.optimizer, self.scheduler = optimizer, scheduler
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Trainer's AcceleratedOptimizer wraps it
        if isinstance(inner, AdamBC):  # its noise: the per-coordinate std in the privatised update, sigma C / (q N)
            inner.bind_noise(self.noise.std / divisor)
        self.private = mech.clip_norm is not None
        self.step, self.examples_processed, self.users_processed = 0, 0, 0
        self.rows: list[dict[str, Any]] = []
        self.resumed_at: list[int] = []

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The model's state in the checkpoint: all of it, or only the trainable tensors when part of the model
        is frozen (LoRA: the adapters, not a copy of the base at every checkpoint)."""
        if all(p.requires_grad for p in self.model.parameters()):
            return self.model.state_dict()
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def _load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if set(state) == trainable and len(trainable) < len(list(self.model.parameters())):
            result = self.model.load_state_dict(state, strict=False)
            if result.unexpected_keys:  # pragma: no cover - the key sets were compared above
                raise ValueError(f"checkpoint has unknown model tensors {result.unexpected_keys[:5]}")
            return
        self.model.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "model": self._model_state(), "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "noise": self.noise.state_dict(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "examples_processed": self.examples_processed, "users_processed": self.users_processed,
            "log": self.rows, "resumed_at": self.resumed_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run (its resumption step is added to resumed_at)."""
        self._load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.noise.load_state_dict(state["noise"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])  # dropout of loaded models on CUDA
        self.step = int(state["step"])
        self.examples_processed = int(state["examples_processed"])
        self.users_processed = int(state["users_processed"])
        self.rows = list(state["log"])
        self.resumed_at = list(state["resumed_at"]) + [self.step]

    def update(self) -> float:
        """Optimizer and LR-schedule step on the privatised p.grad; the learning rate it used."""
        lr = self.learning_rate()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return lr

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses (of the first parameter group)."""
        if self.scheduler is not None:
            return float(self.scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def record(self, sel: StepSelection, sums: StepSums, lr: float, seconds: float,
               update_norms: tuple[float, float] = (math.nan, math.nan)) -> dict[str, Any]:
        """Count the finished step and append its log row (LOG_COLUMNS; plain Python values, as the checkpoint
        is loaded with weights_only). Every column is kept in memory and in the checkpoint; which of them are
        written out is step_log.released_columns."""
        self.step += 1
        self.examples_processed += int(sel.n_examples)
        self.users_processed += int(sel.n_users)
        row = {
            "step": self.step,
            "learning_rate": float(lr),
            "update_norm": float(update_norms[0]),
            "update_signal_norm": float(update_norms[1]),
            "loss": float(sums.loss_sum / sums.n_rows) if sums.n_rows else math.nan,
            "realised_examples": int(sel.n_examples),
            "realised_users": int(sel.n_users),
            "realised_units": int(sel.n_units),
            "examples_processed": self.examples_processed,
            "clipped_fraction": float(sums.clipped / sums.n_units) if sums.n_units and self.private else math.nan,
            "mean_unit_norm": float(sums.norm_sum / sums.norm_n) if sums.norm_n else math.nan,
            "nonfinite_units": int(sums.nonfinite_units),
            "seconds": float(seconds),
        }
        self.rows.append(row)
        return row

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=LOG_COLUMNS)


class _Progress:
    """Logs step and ETA every `every_s` seconds (and at the last step); the batch loss and throughput only with
    training.debug_step_log (noise-free functions of the sampled users, outside the guarantee: step_log)."""

    def __init__(self, total_steps: int, every_s: float, debug: bool = False):
        self.total, self.every_s, self.debug = total_steps, every_s, debug
        self.start = time.monotonic()
        self.last = self.start - every_s

    def __call__(self, run: RunState, done_now: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s and run.step != self.total:
            return
        self.last = now
        elapsed = now - self.start
        eta = (self.total - run.step) * elapsed / done_now
        if not self.debug:
            log.info("step %d/%d ETA %.0fs", run.step, self.total, eta)
            return
        ex_rate = sum(r["realised_examples"] for r in run.rows[-done_now:]) / max(elapsed, 1e-9)
        log.info("step %d/%d loss %.4f examples/s %.1f ETA %.0fs [%s: outside the guarantee]", run.step,
                 self.total, run.rows[-1]["loss"], ex_rate, eta, step_log.KEY)


class StopOnSigterm:
    """While training, SIGTERM (SLURM's preemption and time-limit signal, snakemake's stop) asks the loop to stop
    after the step in progress, save the checkpoint atomically and exit with 128 + SIGTERM, so that the
    resubmitted job resumes there instead of from the last periodic checkpoint. Only in the main thread of a
    single-process run (data-parallel ranks stop at different steps; they keep the previous handler).
    A previous handler that is another StopOnSigterm's is called too, so that a caller running several runs
    in turn (finetune_job.launch_sweep, which holds one of these between runs) learns of a SIGTERM that
    arrived in the last step of a run that then completed. Any other handler (errors.run_main's, which stops
    the job at once) is not: it would stop the step in progress before the checkpoint is saved."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: object) -> None:
        self.requested = True
        if isinstance(getattr(self._previous, "__self__", None), StopOnSigterm):
            self._previous(signum, frame)

    def __enter__(self) -> "StopOnSigterm":
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)


@dataclass(frozen=True)
class RunContext:
    """What every phase of one run reads: its spec and mechanism, its data, settings, files and placement."""

    spec: RunSpec
    mech: RunMechanism
    pool: TrainingPool
    settings: TrainSettings
    paths: RunPaths | None  # None: a `setup` run that writes nowhere (yet)
    pad_id: int
    device: torch.device
    dist: distributed.DistContext | None

    @property
    def main(self) -> bool:
        """Whether this process writes files and adds the noise (rank 0, or the only process)."""
        return self.dist is None or self.dist.is_main

    def withheld(self, value: Any) -> Any:
        """`value`, or None when the plan's sizes come from the DP contribution statistics: sizes of the pool and
        the realised compute are then statistics of the counts (with q and T they would give back N_G)."""
        return None if self.spec.sizes_from_release else value


@dataclass
class Run:
    """One prepared run: its context, the state it advances, its step, and the keys of its checkpoint
    (`fingerprint`) and of its finished record (`done_key`)."""

    ctx: RunContext
    state: RunState
    step: DPStep
    seeds: dict[str, Any]
    fingerprint: str = ""  # set by `prepare` (train's runs); a `setup` run has no checkpoint
    done_key: str = ""
    saved_at: int = 0  # the step of the last checkpoint written (or resumed from) in this invocation
    unchecked: bool = True  # the first update at a learning rate > 0 of this invocation must move a parameter

    def advance(self, on_step: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
        """One noisy step (`privatize`), the optimizer's update, the step counted and logged (`complete`); its log
        row. The one step body of every client (`loop`, PrivateTraining.step; UserDPTrainer runs the two halves
        around Trainer's own optimizer step)."""
        pending = self.privatize()
        self.state.update()
        return self.complete(pending, on_step)

    def privatize(self) -> "PendingStep":
        """DPStep (sample, clipped sum, noise once, divide): p.grad holds the privatised update; what `complete`
        needs once the optimizer has stepped."""
        t0 = time.monotonic()
        sel, sums = self.step()
        norms = self.step.update_norms()  # before the optimizer step, which may touch p.grad
        before = _fingerprints(self.state.params) if self.unchecked else None
        return PendingStep(sel, sums, norms, self.state.learning_rate(), t0, before)

    def complete(self, pending: "PendingStep", on_step: Callable[[int, dict], None] | None = None
                 ) -> dict[str, Any]:
        """After the optimizer's update of a step: count and log it, check that the first update at a learning
        rate > 0 moved a parameter, call `on_step` (step, row), then the hook; the log row."""
        state, p = self.state, pending
        row = state.record(p.selection, p.sums, p.learning_rate, time.monotonic() - p.started, p.norms)
        if p.before is not None and row["learning_rate"] > 0:  # a zero rate (warm-up, replay tests) moves nothing
            _check_moved(state.params, p.before, state.step)
            self.unchecked = False
        if on_step is not None:
            on_step(state.step, row)
        self.step.hook.after_step(state.step, p.selection, p.sums)
        return row


@dataclass(frozen=True)
class PendingStep:
    """A privatised step whose optimizer update is still to come (Run.privatize -> update -> Run.complete)."""

    selection: StepSelection
    sums: StepSums
    norms: tuple[float, float]     # (||u||, its noise-corrected estimate) of the privatised update
    learning_rate: float           # the rate the coming optimizer step uses
    started: float                 # time.monotonic() at the step's start
    before: torch.Tensor | None    # the parameters' fingerprints before the update (None: not checked)


def train(model: torch.nn.Module, pool: TrainingPool, spec: RunSpec | dict[str, Any], settings: TrainSettings,
          paths: RunPaths, seeds: dict[str, Any], pad_id: int, *, gradient_source: GradientSourceFactory | None = None,
          compute_epsilon: Callable[..., float] | None = None, max_steps: int | None = None,
          on_step: Callable[[int, dict], None] | None = None, dist: distributed.DistContext | None = None,
          observe: Callable[[StepObservation], None] | None = None) -> TrainOutcome:
    """Run (or resume) DP fine-tuning of `model` on `pool` with the mechanism of `spec` (a RunSpec or its record).

    The run's phases, in order: `prepare` -> `restore_finished` (a run that finished before: its outputs are
    linked back, nothing trains) or `resume_or_start` (its checkpoint, or the torch seed) -> `loop` -> `finish`
    (model, log, ledger) or `interrupt` (checkpoint saved; `Preempted` on SIGTERM, the job exits 143).

    gradient_source: `(model, clip_norm, normalize=...) -> GradientSource` (default: clipping.ClippedGradients).
    compute_epsilon: the ledger's accountant, `(dp event, delta) -> epsilon` (default: the PLD accountant;
    tests pass a fast stand-in). max_steps: stop after this many steps in this invocation (checkpointing first);
    the run then reports complete=False and writes no final outputs. on_step: called after every step with
    (step, log row); an exception in it interrupts the run like a crash would. dist: this process's rank in a
    data-parallel group (default: an initialised torch.distributed group; None = one process). observe: called
    after every step, on every rank, with its StepObservation (the `Observer` hook); None copies nothing.
    """
    hook = Observer(observe) if observe is not None else None
    run = prepare(model, pool, RunSpec.from_record(spec), settings, paths, seeds, pad_id, dist, gradient_source,
                  hook)
    restored = restore_finished(run)
    if restored is not None:
        return restored
    resume_or_start(run)
    stopped = loop(run, max_steps, on_step)
    if run.state.step < run.ctx.mech.steps:
        return interrupt(run, stopped)
    return finish(run, compute_epsilon)


def setup(model: torch.nn.Module, pool: TrainingPool, spec: RunSpec, settings: TrainSettings,
          paths: RunPaths | None, seeds: dict[str, Any], pad_id: int, dist: distributed.DistContext | None = None,
          gradient_source: GradientSourceFactory | None = None, hook: StepHook | None = None, *,
          optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> Run:
    """Place the model, draw secret seeds, build the state and the step (nothing trains yet): the core every
    client drives (`train` below, `training.private.PrivateTraining`), one `advance` per noisy step.

    optimizer / scheduler: the caller's (None: training.optimizer and training.schedule of `settings`). paths:
    where `train` checkpoints and writes (None: nowhere yet; PrivateTraining.save names the folder).
    """
    mech = RunMechanism.of(spec, pool, settings)
    dist = distributed.current_context() if dist is None else dist
    device = distributed.rank_device(settings.device, dist) if dist is not None else resolve_device(settings.device)
    model.to(device)
    if settings.gradient_checkpointing:
        # non-reentrant: the kind DP clipping supports (its hooks see the first forward's graph)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if seeds.get("secret"):
        # Fresh entropy at every start; a resumed run restores the sampler's and the noise's RNG states from its
        # checkpoint, so it continues the same secret streams. Only the checkpoint (deleted at the end) holds them.
        seeds = draw_secret_seeds(seeds, dist, device)
    ctx = RunContext(spec, mech, pool, settings, paths, pad_id, device, dist)
    n_units = mech.n_units(pool)
    divisor = divisor_for(spec, mech, n_units, mech.rate * n_units)  # q N, the sampler's expected size
    state = RunState(model, mech, pool, settings, seeds, device, optimizer, scheduler, divisor)
    grads = (gradient_source or _default_gradient_source())(model, mech.clip_norm, normalize=mech.normalize)
    return Run(ctx, state, DPStep(ctx, state, grads, divisor, hook), seeds)


def prepare(model: torch.nn.Module, pool: TrainingPool, spec: RunSpec, settings: TrainSettings, paths: RunPaths,
            seeds: dict[str, Any], pad_id: int, dist: distributed.DistContext | None,
            gradient_source: GradientSourceFactory | None, hook: StepHook | None) -> Run:
    """`setup`, plus the run's keys: its checkpoint's fingerprint and its finished record's key."""
    run = setup(model, pool, spec, settings, paths, seeds, pad_id, dist, gradient_source, hook)
    ctx = run.ctx
    fp = run_fingerprint(spec, settings, ctx.device, run.seeds, pool, model, ctx.mech.n_units(pool))
    # The finished record's key covers everything the outputs depend on, beyond what a resume needs (fp: the
    # result-changing settings): the whole plan (the ledger's accounting fields), debug_step_log (which columns
    # are released) and the adapter's settings (LoRA alpha and dropout add no tensors to the model digest).
    run.fingerprint = fp
    run.done_key = ckpt.fingerprint({"resume": fp, "plan": spec.without_timing(),
                                     "debug_step_log": settings.debug_step_log, "adapter": _adapter_record(model)})
    return run


def restore_finished(run: Run) -> TrainOutcome | None:
    """A finished attempt whose outputs snakemake never recorded (it was killed): its outputs linked back and
    its outcome; None when there is none (or it does not match this run's key)."""
    ctx = run.ctx
    found = finished.restore(ctx.paths.run_dir, run.done_key, ctx.paths.log) if ctx.main else None
    if not distributed.broadcast_object(found, ctx.dist, ctx.device):
        return None
    if ctx.main:
        ckpt.remove_checkpoint(ctx.paths.checkpoint_dir)
    ledger = read_json(ctx.paths.ledger)
    return TrainOutcome(True, int(ledger["steps_completed"]), ledger, read_frame(ctx.paths.train_log))


def resume_or_start(run: Run) -> None:
    """Continue from the run's checkpoint when one matches its fingerprint; otherwise seed torch for step 1."""
    ctx = run.ctx
    saved = ckpt.load_checkpoint(ctx.paths.checkpoint_dir, run.fingerprint)
    if saved is not None:
        run.state.load_state_dict(saved)
        log.info("resumed from checkpoint at step %d/%d (%s)", run.state.step, ctx.mech.steps,
                 ctx.paths.checkpoint_dir)
    else:
        torch.manual_seed(run.seeds["torch"])


def _save_checkpoint(run: Run) -> None:
    if run.ctx.main:  # every rank holds the same state; rank 0 writes it
        ckpt.save_checkpoint(run.ctx.paths.checkpoint_dir, {"fingerprint": run.fingerprint, **run.state.state_dict()})


def _log_start(run: Run) -> None:
    ctx, mech = run.ctx, run.ctx.mech
    # With DP contribution statistics the pool's exact size N_G is a statistic of the counts: not logged.
    pool_size = ctx.withheld(str(ctx.pool.n_examples)) or "withheld (DP contribution statistics)"
    log.info("training %s: T=%d q=%.6g expected %s=%.2f sigma=%.4g C=%s G=%d pool=%s examples/%d users lr=%g "
             "device=%s processes=%d", mech.method, mech.steps, mech.rate, mech.unit_name, run.step.expected,
             mech.sigma, mech.clip_norm, mech.group_size, pool_size, ctx.pool.n_users, ctx.settings.learning_rate,
             ctx.device, ctx.dist.world_size if ctx.dist is not None else 1)


def loop(run: Run, max_steps: int | None, on_step: Callable[[int, dict], None] | None) -> bool:
    """Train until step T, SIGTERM or `max_steps` steps of this invocation; True when SIGTERM stopped it.

    Checkpoints every training.checkpoint_every steps (and checks that data-parallel replicas agree there).
    """
    ctx, state = run.ctx, run.state
    _log_start(run)
    progress, done_now = _Progress(ctx.mech.steps, ctx.settings.log_every_s, ctx.settings.debug_step_log), 0
    run.saved_at = state.step
    with StopOnSigterm(enabled=ctx.dist is None) as stop:
        while state.step < ctx.mech.steps and not stop.requested and (max_steps is None or done_now < max_steps):
            done_now += 1
            run.advance(on_step)
            if state.step % ctx.settings.checkpoint_every == 0 and state.step < ctx.mech.steps:
                _save_checkpoint(run)
                run.saved_at = state.step
                distributed.check_replicas(state.params, ctx.dist, ctx.device)
            progress(state, done_now)
    return stop.requested


def interrupt(run: Run, sigterm: bool) -> TrainOutcome:
    """Before step T: save the checkpoint (unless this step's is saved); `Preempted` on SIGTERM."""
    ctx, state = run.ctx, run.state
    if run.saved_at != state.step:
        _save_checkpoint(run)
    distributed.broadcast_object(None, ctx.dist, ctx.device)  # no rank returns before the checkpoint is written
    if sigterm:
        log.warning("SIGTERM: stopped after step %d/%d; checkpoint saved, the resubmitted job resumes from it",
                    state.step, ctx.mech.steps)
        raise Preempted(f"stopped by SIGTERM after step {state.step}/{ctx.mech.steps}; checkpoint saved")
    log.info("stopped at step %d/%d; checkpoint saved, rerun to resume", state.step, ctx.mech.steps)
    return TrainOutcome(False, state.step, None, state.frame())


def _adapter_record(model: torch.nn.Module) -> dict[str, Any] | None:
    """The LoRA adapter's settings (peft's config) of a PeftModel, None for full fine-tuning."""
    cfg = getattr(model, "peft_config", None)
    if not cfg:
        return None
    c = cfg["default"]
    return {"type": "lora", "r": int(c.r), "alpha": float(c.lora_alpha), "dropout": float(c.lora_dropout),
            "target_modules": sorted({t.rsplit(".", 1)[-1] for t in c.target_modules}),
            "base_model": c.base_model_name_or_path}


@torch.no_grad()
def _fingerprints(params: list[torch.Tensor]) -> torch.Tensor:
    """Two float64 sums per parameter (of x and of x^2): they change when the parameter does."""
    return torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]).cpu() for p in params])


def _check_moved(params: list[torch.Tensor], before: torch.Tensor, step: int) -> None:
    """Fail loudly when the first update at a learning rate > 0 of this invocation changed no trainable parameter.

    An update that moves nothing (e.g. adapters no gradient reaches, in a run without noise) would train for
    hours and release the base model; the noise alone moves every parameter of a private run. Steps at a zero
    learning rate (a warm-up's first step, replay tests) are not checked.
    """
    moved = (_fingerprints(params) != before).any(dim=1)
    if not bool(moved.any()):
        raise RuntimeError(f"step {step}: the update changed none of the {len(params)} trainable parameters "
                           "(no gradient or noise reached them); check model.lora (its target_modules) and the "
                           "model's trainable parameters.")


def run_facts(run: Run) -> RunFacts:
    """What the finished run did, for its ledger (sizes withheld with DP contribution statistics)."""
    ctx, state = run.ctx, run.state
    # Units dropped for a NaN/inf gradient (they contributed zero: clipping.py): released only with
    # training.debug_step_log, like the per-step log.
    dropped = sum(int(r.get("nonfinite_units", 0)) for r in state.rows)
    if dropped and ctx.settings.debug_step_log:
        log.warning("%d sampled unit(s) had a non-finite gradient and contributed nothing [%s: outside the "
                    "guarantee]", dropped, step_log.KEY)
    return RunFacts(
        steps_completed=state.step, expected_batch=run.step.expected, n_train_users=ctx.pool.n_users,
        learning_rate=ctx.settings.learning_rate, training=asdict(ctx.settings), seeds=public_seeds(run.seeds),
        resumed_at=tuple(state.resumed_at), n_pool_examples=ctx.withheld(ctx.pool.n_examples),
        examples_processed=ctx.withheld(state.examples_processed), users_processed=ctx.withheld(state.users_processed),
        n_examples_before_bounding=ctx.withheld(ctx.pool.n_examples_before_bounding), device=str(ctx.device),
        precision=ctx.settings.precision if ctx.device.type == "cuda" else "fp32",
        processes=ctx.dist.world_size if ctx.dist is not None else 1,
        trainable_parameters=sum(p.numel() for p in state.params), adapter=_adapter_record(state.model),
        nonfinite_units=dropped if ctx.settings.debug_step_log else None,
        loss_tokens=None if ctx.pool.loss_mask_values is None else "answers",
    )


def write_release(run: Run, paths: RunPaths, compute_epsilon: Callable[..., float] | None = None
                  ) -> dict[str, Any]:
    """Write what the run releases into `paths` (rank 0): the model (or adapter), the per-step log, the ledger
    of the steps that ran and the model card rendered from it (in the run folder and the model folder); the
    ledger."""
    save_model_atomic(run.state.model, paths.model_dir)
    ledger = write_records(run, paths.run_dir, compute_epsilon)
    model_card.write_card(paths.model_dir, ledger)  # replaces peft's empty template: the folder one uploads
    return ledger


def write_records(run: Run, folder: str | Path, compute_epsilon: Callable[..., float] | None = None
                  ) -> dict[str, Any]:
    """The records of a released model in `folder`: the per-step log, the ledger of the steps that ran and the
    model card rendered from it (a Trainer's folder holds the model files beside them); the ledger."""
    ctx, state = run.ctx, run.state
    paths = RunPaths(Path(folder))
    ledger = build_ledger(ctx.spec, run_facts(run), compute_epsilon)
    # Per-step noise-free values (batch loss, realised sizes, timing) only with training.debug_step_log.
    write_parquet(paths.train_log, state.frame()[step_log.released_columns(ctx.settings.debug_step_log)])
    write_json(paths.ledger, ledger)
    model_card.write_card(paths.run_dir, ledger)
    return ledger


def finish(run: Run, compute_epsilon: Callable[..., float] | None) -> TrainOutcome:
    """After step T: rank 0 writes model, log and ledger, records them (`finished`, under the run's done_key),
    then deletes the checkpoint; other ranks wait for the ledger."""
    ctx, state = run.ctx, run.state
    frame = state.frame()
    distributed.check_replicas(state.params, ctx.dist, ctx.device)
    if not ctx.main:
        return TrainOutcome(True, state.step, distributed.broadcast_object(None, ctx.dist, ctx.device), frame)
    paths = ctx.paths
    ledger = write_release(run, paths, compute_epsilon)
    # Outputs are complete: record them, so a rerun snakemake asks for (it was killed before recording them)
    # restores instead of retraining; the checkpoint is no longer needed (as large as model + optimizer state,
    # and it holds the secret noise state).
    try:
        finished.record(paths.run_dir, [paths.model_dir, paths.train_log, paths.ledger, paths.card], run.done_key,
                        paths.log)
    except OSError as exc:  # the outputs are complete; without the record a rerun would only train again
        log.warning("could not record the finished outputs in %s (%s); the run is complete, but if snakemake "
                    "reruns it (e.g. after being killed) it trains again", paths.run_dir / "finished", exc)
    ckpt.remove_checkpoint(paths.checkpoint_dir)
    distributed.broadcast_object(ledger, ctx.dist, ctx.device)
    log.info("run complete: %d steps, epsilon %.4g, realised compute %s", state.step, ledger["epsilon"],
             "withheld (DP contribution statistics)" if ctx.spec.sizes_from_release else
             f"{state.examples_processed} examples ({ledger['compute_ratio'] or math.nan:.3f} of budget)")
    return TrainOutcome(True, state.step, ledger, frame)
