"""The state of one training run, step to step: where it writes (`RunPaths`), its mechanism checked against the
pool (`RunMechanism`), what a step sums (`StepSums`, which the state's log records), everything its
checkpoint holds (`RunState`), and what a checkpoint must match to be resumed (`run_fingerprint`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..errors import DataError, PrivacyError
from ..layout import LEDGER, RUN_MODEL, TRAIN_LOG
from ..privacy import mechanism as privacy_mechanism
from ..privacy.adaptive import AdaptiveClipping
from ..privacy.banded import CorrelatedNoise
from ..privacy.spec import RunSpec
from . import checkpoint as ckpt
from . import model_card, step_log
from . import distributed
from .batching import StepSelection
from .gradients import MicroBatchStats
from .noise import BandedNoise, GaussianNoise
from .optim import AdamBC, make_optimizer, make_scheduler
from .pool import TrainingPool
from .run_seeds import public_seeds
from .sampling import CyclicPoissonSampler, PoissonSampler
from .settings import TrainSettings, check_uls_fits

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


def run_fingerprint(spec: RunSpec, settings: TrainSettings, device: torch.device, seeds: dict[str, Any],
                    pool: TrainingPool, model: torch.nn.Module, n_units: int) -> str:
    """What a checkpoint must match to be resumed: the mechanism, the result-changing settings
    (TrainSettings.result_settings, with the device type the run uses), the public seeds, and the
    content of the base model and the pool (a rebuilt model or training data must not resume an old run).
    """
    return ckpt.fingerprint({
        "plan": fingerprint_plan(spec),
        "settings": settings.result_settings(device=device.type),
        "seeds": public_seeds(seeds), "n_units": n_units, "n_pool_examples": pool.n_examples,
        "sampler": (PoissonSampler if spec.correlated_noise is None else CyclicPoissonSampler).SCHEME,
        "model": ckpt.model_digest(model),
        "pool": ckpt.arrays_digest(*pool.content_arrays()),
    })


def fingerprint_plan(spec: RunSpec) -> dict[str, Any]:
    """The plan's part of a checkpoint's key (the engine's and UserDPTrainer's): FINGERPRINT_PLAN_KEYS, and adaptive
    clipping's and banded DP-FTRL's settings when they run (only then: other runs' checkpoints keep their keys)."""
    plan = {k: getattr(spec, k) for k in FINGERPRINT_PLAN_KEYS}
    if spec.adaptive_clipping is not None:
        plan["adaptive_clipping"] = dict(spec.adaptive_clipping)
    if spec.correlated_noise is not None:
        plan["correlated_noise"] = dict(spec.correlated_noise)
    return plan


@dataclass
class StepSums:
    """Statistics of one step, summed over its micro-batches (and over ranks after `privatize`).

    With adaptive clipping `privatize` also sets the step's clip norm C_t and its released centred count s_t
    (userdp.privacy.adaptive); `count_noise` is that count's noise, drawn once (rank 0) and summed like the rest.
    """

    loss_sum: float = 0.0
    n_rows: int = 0
    n_units: int = 0
    clipped: float = 0.0   # sum over micro-batches of clipped_fraction * units
    norm_sum: float = 0.0  # sum of the units' pre-clip norms (finite ones)
    norm_n: int = 0
    nonfinite_units: int = 0  # units dropped for a NaN/inf gradient (they contributed zero)
    count_noise: float = 0.0
    clip_norm: float | None = None
    released_count: float | None = None

    #: The fields summed over ranks (the rest are set after the sum).
    SUMMED = ("loss_sum", "n_rows", "n_units", "clipped", "norm_sum", "norm_n", "nonfinite_units", "count_noise")
    _INTS = ("n_rows", "n_units", "norm_n", "nonfinite_units")

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
        totals = distributed.all_reduce_sums([getattr(self, k) for k in self.SUMMED], dist, device)
        return replace(self, **{k: int(v) if k in self._INTS else v for k, v in zip(self.SUMMED, totals)})


@dataclass(frozen=True)
class RunMechanism:
    """The spec's mechanism (`privacy.mechanism`) for one run, with its noise and clipping, checked against the pool."""

    mechanism: privacy_mechanism.Mechanism  # method, q, T, G
    sigma: float           # noise multiplier (0: no noise)
    clip_norm: float | None  # None: non-private reference (no clipping); adaptive clipping: C_0
    normalize: bool        # normalized clipping C g / ||g||
    adaptive: AdaptiveClipping | None = None  # adaptive clipping's settings (privacy.adaptive)
    banded: CorrelatedNoise | None = None  # banded DP-FTRL (privacy.correlated_noise): cyclic sampling, b bands

    @classmethod
    def of(cls, spec: RunSpec, pool: TrainingPool, settings: TrainSettings) -> "RunMechanism":
        mech = spec.mechanism
        if pool.group_size != mech.group_size:
            raise DataError(f"the training pool was bounded with G = {pool.group_size} but the plan says group_size "
                            f"{mech.group_size}.")
        if mech.unit == "users":
            # ULS micro-batches hold whole users: the largest user must fit in one
            check_uls_fits(mech.group_size, settings.physical_batch_size, settings.uls_examples_per_user,
                           key="the plan")
        clip_norm = None if spec.clip_norm is None else float(spec.clip_norm)
        return cls(mech, float(spec.noise_multiplier), clip_norm, spec.normalized,
                   spec.adaptive if spec.private else None, spec.banded)

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

    def expected_batch(self, pool: TrainingPool) -> float:
        """The sampler's expected size: q N, or p N / b with banded DP-FTRL's cyclic sampling."""
        return self.rate * self.n_units(pool) / (1 if self.banded is None else self.banded.bands)


class RunState:
    """Everything a run carries from step to step; `state_dict` is what its checkpoint holds."""

    def __init__(self, model: torch.nn.Module, mech: RunMechanism, pool: TrainingPool, settings: TrainSettings,
                 seeds: dict[str, Any], device: torch.device, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, divisor: float = 1.0):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Per-unit keyed draws: removing a user changes no other unit's draws (sampling.py)
        self.banded = mech.banded  # banded DP-FTRL (userdp.privacy.banded), None: DP-SGD's independent noise
        if self.banded is None:
            self.sampler = PoissonSampler.for_pool(pool, mech.unit_name, mech.rate, seeds["sampler"])
        else:
            self.banded.check_fits(sum(p.numel() for p in self.params), settings.max_noise_buffers_gb)
            self.sampler = CyclicPoissonSampler(pool.user_ids, mech.rate, seeds["sampler"], self.banded.bands)
        self.divisor = float(divisor)  # what the noisy sum is divided by (step.divisor_for); DPStep reads it
        self.adaptive = mech.adaptive
        sigma = mech.sigma
        if self.adaptive is not None:  # the gradient's share of the step's noise (the count gets the rest)
            try:
                sigma = self.adaptive.gradient_noise_multiplier(mech.sigma, self.divisor)
            except PrivacyError as exc:
                raise DataError(f"{exc} (the plan does not fit this pool's divisor; rebuild the plan)") from None
        self.noise = (GaussianNoise(sigma, mech.clip_norm, seeds["noise"], device) if self.banded is None else
                      BandedNoise(sigma, mech.clip_norm, seeds["noise"], self.banded.coefficients, mech.steps,
                                  device))
        #: The clip norm of the coming step (adaptive clipping moves it after every step; checkpointed).
        self.clip_norm = mech.clip_norm
        if optimizer is None:  # the pipeline's: training.optimizer, training.schedule
            self.optimizer = make_optimizer(self.params, settings.optimizer, settings.learning_rate)
            self.scheduler = make_scheduler(self.optimizer, settings.schedule, settings.warmup_steps, mech.steps)
        else:  # the caller's own (userdp.make_private): its scheduler, if any, is stepped with it
            self.optimizer, self.scheduler = optimizer, scheduler
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Trainer's AcceleratedOptimizer wraps it
        self._bias_corrected = inner if isinstance(inner, AdamBC) else None
        self.step, self.examples_processed, self.users_processed = 0, 0, 0
        self.apply_clip_norm()
        self.private = mech.clip_norm is not None
        self.rows: list[dict[str, Any]] = []
        self.resumed_at: list[int] = []

    @property
    def noise_varies(self) -> bool:
        """Whether the update's noise std changes from step to step (adaptive clipping's C_t; banded noise's
        marginal std grows over the first steps): the step then calls `apply_clip_norm` every time."""
        return self.adaptive is not None or self.banded is not None

    def apply_clip_norm(self) -> None:
        """Scale the coming step's noise (and AdamBC's correction) to `clip_norm`: the noise std sigma C, and the
        per-coordinate std of the privatised update sigma C / (q N) that AdamBC subtracts (banded noise: its
        marginal std, sigma C ||row t of C^-1|| / m)."""
        self.noise.clip_norm = self.clip_norm
        if self._bias_corrected is not None:  # with adaptive clipping its noise follows C_t, step by step
            self._bias_corrected.bind_noise(self.noise.step_std(self.step) / self.divisor, varying=self.noise_varies)

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
            "log": self.rows, "resumed_at": self.resumed_at, "clip_norm": self.clip_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run (its resumption step is added to resumed_at)."""
        self._load_model_state(state["model"])
        self.clip_norm = state.get("clip_norm", self.clip_norm)
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
        self.apply_clip_norm()

    def update(self) -> None:
        """Optimizer and LR-schedule step on the privatised p.grad."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses (of the first parameter group)."""
        if self.scheduler is not None:
            return float(self.scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def record(self, sel: StepSelection, sums: StepSums, lr: float, seconds: float,
               update_norms: tuple[float, float] = (math.nan, math.nan)) -> dict[str, Any]:
        """Count the finished step and append its log row (step_log.released_columns with debug; plain Python values,
        as the checkpoint is loaded with weights_only). Every column is kept in memory and in the checkpoint; which
        of them are written out is step_log.released_columns."""
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
        if self.adaptive is not None:  # released: C_t and the noisy unclipped fraction (userdp.privacy.adaptive)
            row["clip_norm"] = float(sums.clip_norm)
            row["unclipped_fraction_noisy"] = self.adaptive.noisy_fraction(sums.released_count, self.divisor)
        self.rows.append(row)
        return row

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=step_log.released_columns(True, self.adaptive is not None))
