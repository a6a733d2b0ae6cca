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
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

from ..errors import Preempted
from ..logutil import Progress
from ..io import read_frame, read_json, write_json, write_parquet
from ..privacy.spec import RunSpec
from . import checkpoint as ckpt
from . import distributed, finished, model_card, step_log
from .batching import StepSelection
from .gradients import GradientSourceFactory
from .ledger import RunFacts, build_ledger
from .models import resolve_device, save_model_atomic
from .pool import TrainingPool
from .run_seeds import draw_secret_seeds, public_seeds
from .run_state import RunMechanism, RunPaths, RunState, StepSums, run_fingerprint
from .settings import TrainSettings
from .step import DPStep, Observer, RunContext, StepHook, StepObservation, default_gradient_source, divisor_for

log = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    complete: bool
    steps_completed: int
    ledger: dict[str, Any] | None
    log: pd.DataFrame


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
    divisor = divisor_for(spec, mech, n_units, mech.expected_batch(pool))  # q N (p N / b), the sampler's expected size
    state = RunState(model, mech, pool, settings, seeds, device, optimizer, scheduler, divisor)
    grads = (gradient_source or default_gradient_source())(model, mech.clip_norm, normalize=mech.normalize)
    return Run(ctx, state, DPStep(ctx, state, grads, hook), seeds)


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
    progress = Progress(log, ctx.mech.steps, "step", ctx.settings.log_every_s, start=state.step, first=True)
    done_now = 0
    run.saved_at = state.step
    with StopOnSigterm(enabled=ctx.dist is None) as stop:
        while state.step < ctx.mech.steps and not stop.requested and (max_steps is None or done_now < max_steps):
            done_now += 1
            run.advance(on_step)
            if state.step % ctx.settings.checkpoint_every == 0 and state.step < ctx.mech.steps:
                _save_checkpoint(run)
                run.saved_at = state.step
                distributed.check_replicas(state.params, ctx.dist, ctx.device)
            progress.update(1, _debug_progress(state, done_now, progress) if ctx.settings.debug_step_log else "")
    return stop.requested


def _debug_progress(state: RunState, done_now: int, progress: Progress) -> Callable[[], str]:
    """With training.debug_step_log: the batch loss and examples/s on the progress line (noise-free functions of
    the sampled users, outside the guarantee: step_log)."""
    def text() -> str:
        seconds = max(time.monotonic() - progress.start, 1e-9)
        ex_rate = sum(r["realised_examples"] for r in state.rows[-done_now:]) / seconds
        return f"loss {state.rows[-1]['loss']:.4f} examples/s {ex_rate:.1f} [{step_log.KEY}: outside the guarantee]"
    return text


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
        adaptive_clipping=None if state.adaptive is None else {
            **state.adaptive.record(), "gradient_noise_multiplier": state.noise.noise_multiplier,
            "count_noise_std": state.adaptive.count_std(state.divisor), "clip_norm_final": state.clip_norm},
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
    write_parquet(paths.train_log, state.frame()[step_log.released_columns(ctx.settings.debug_step_log,
                                                                            state.adaptive is not None)])
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
