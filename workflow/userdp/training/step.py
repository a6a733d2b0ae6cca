"""One DP-SGD step of the mechanism (`DPStep`: sample -> clipped sum -> noise once -> divide, Opacus'
pre_step order; docs/method.md sections 3 and 4), the public divisor it uses (`divisor_for`), what a step
sums (`StepSums`), and the hook through which tests and audits observe it (`StepHook`, `Observer`). The
engine (userdp.training.engine) drives it; `RunContext` is what every phase of a run reads."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError, DataError
from ..privacy.spec import RunSpec
from . import distributed, step_log
from .batching import StepSelection, pack_micro_batches, select_els, select_uls
from .gradients import GradientSource, GradientSourceFactory
from .models import autocast_context
from .pool import TrainingPool
from .run_state import RunMechanism, RunPaths, RunState, StepSums
from .settings import TrainSettings

log = logging.getLogger(__name__)


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
class StepObservation:
    """What one step computed, handed to `train(observe=...)` by the `Observer` step hook.

    The hook for tests and audits of the mechanism (tests/test_replay_neighbouring.py): on D and on D
    minus one user, with the same seeds, every step must sample the same other units, draw the same
    noise and have clipped sums at most k_t C (ELS) or C (ULS) apart.

    step: 1-based. selection: the sampled units (pool rows of every unit, StepSelection; map them to
    users with pool.example_user). clipped_sum: per trainable parameter, the sum over all ranks of the
    clipped per-unit gradients, before noise (an extra all-reduce with several processes, only when
    observing). noise: the noise rank 0 added to it (None on other ranks and when sigma or C is 0).
    nonfinite_units: units dropped for a non-finite gradient. clip_norm, released_count: with adaptive clipping,
    the step's clip norm C_t and its released centred count s_t (userdp.privacy.adaptive); None otherwise.
    """

    step: int
    selection: StepSelection
    clipped_sum: list[torch.Tensor]
    noise: list[torch.Tensor] | None
    nonfinite_units: int
    clip_norm: float | None = None
    released_count: float | None = None


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
        self.fn(StepObservation(step, selection, self._clipped, self._noise or None, sums.nonfinite_units,
                                sums.clip_norm, sums.released_count))


def default_gradient_source() -> GradientSourceFactory:
    from .clipping import ClippedGradients

    return ClippedGradients


class DPStep:
    """One DP-SGD step of the mechanism: `sample` -> `clipped_sum` -> `privatize` (Opacus' pre_step order).

    Leaves the privatised update direction (noisy clipped sum / divisor) in p.grad
    of every trainable parameter; the optimizer step is the caller's.
    """

    def __init__(self, ctx: "RunContext", state: "RunState", grads: GradientSource, hook: StepHook | None = None):
        self.ctx, self.grads, self.hook = ctx, grads, hook or StepHook()
        self.mech, self.pool, self.settings, self.dist = ctx.mech, ctx.pool, ctx.settings, ctx.dist
        self.state, self.sampler, self.noise, self.params = state, state.sampler, state.noise, state.params
        self.adaptive = state.adaptive  # adaptive clipping (userdp.privacy.adaptive), None: a fixed clip norm
        if self.adaptive is not None and not hasattr(grads, "clip_norm"):
            raise ConfigError(f"adaptive clipping moves the clip norm every step, but the gradient source "
                              f"{type(grads).__name__} has no clip_norm attribute to set (GradientSource): it would "
                              "keep clipping at C_0 while the noise follows C_t.")
        # The divisor, decided once by `divisor_for` (the state's): q N, or the plan's public expected batch with
        # DP contribution statistics (no fallback to the pool's exact size here).
        self.expected = state.divisor
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
        if self.state.noise_varies:  # this step's C_t (adaptive) and noise std: the noise and AdamBC follow them
            self.state.apply_clip_norm()
        if self.adaptive is not None:  # the clipping follows C_t too
            self.grads.clip_norm = self.state.clip_norm
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
            if self.adaptive is not None:  # and the count's noise, once, from the same generator
                sums.count_noise = self.noise.draw(self.adaptive.count_std(self.expected))
        if self.dist is not None and self.dist.active:
            distributed.all_reduce_grads_of([p.grad for p in self.params], self.dist)
        sums = sums.summed_over_ranks(self.dist, self.ctx.device)
        for p in self.params:
            p.grad.div_(self.expected)
        if self.adaptive is not None:
            self.release_count(sums)
        return sums

    def release_count(self, sums: StepSums) -> None:
        """Adaptive clipping: the step's released centred count s_t = sum_u (1[||g_u|| <= C_t] - 1/2) + noise, and
        the next step's clip norm C_{t+1} from it (post-processing; userdp.privacy.adaptive). A unit dropped for a
        non-finite gradient counts as clipped. Every rank holds the same totals, so every rank moves C alike."""
        sums.clip_norm = float(self.state.clip_norm)
        unclipped = sums.n_units - round(sums.clipped)  # `clipped`: the units above C_t (and the non-finite)
        sums.released_count = unclipped - 0.5 * sums.n_units + sums.count_noise
        fraction = self.adaptive.noisy_fraction(sums.released_count, self.expected)
        self.state.clip_norm = self.adaptive.next_clip_norm(sums.clip_norm, fraction)

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
        return math.sqrt(sq), step_log.signal_norm(sq, d, self.noise.step_std(self.state.step), self.expected)


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
