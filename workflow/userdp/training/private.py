"""User-level DP training of the caller's own model and optimizer, one noisy step at a time.

`PrivateTraining` is what `userdp.make_private` returns and what
`userdp.UserDPTrainer` drives. It holds the engine's own run
(`engine.setup`: the Poisson sampler keyed per unit, the book-keeping
clipping, the Gaussian noise generator, the division by the expected batch
q N) around the caller's `nn.Module` (a `PeftModel` too) and
`torch.optim.Optimizer`, and `step()` is `engine.Run.advance`, the step
body the pipeline's runs execute: the privacy invariants of docs/method.md
section 11 hold here because it is the same code.

Before every step it refuses, with a ConfigError that says how to fix it,
the silent failures users of other DP libraries hit:

- an optimizer over other parameters than the model's trainable ones (or
  missing some): noise and clipping cover exactly the trainable ones;
- the set of trainable parameters changed since `make_private`;
- a model moved to another device after `make_private` (the noise
  generator, the optimizer's state and the sampled batches stay behind:
  opacus#820's silent LoRA corruption);
- gradients present before the step (a `backward()` outside `step()`
  would be overwritten or, worse, meant to be added: the DP step computes
  every gradient itself). `step()` leaves p.grad empty (None) after the
  optimizer's update, so the next check is exact;
- more steps than the plan's T: the accountant covered T.

A trainable layer of a type with no registered handler is refused when the
training is built (clipping.UnsupportedModelError, a ConfigError): its
per-unit gradient would otherwise be dropped from the clipping.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError, PrivacyError
from ..privacy.spec import RunSpec
from . import engine, run_state, step
from .ledger import build_ledger, guarantee_epsilon
from .pool import TrainingPool
from .settings import TrainSettings


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step's statistics (a row of the step log).

    `loss` (the sampled rows' mean loss), `realised_*` and `clipped_fraction` are noise-free statistics of the
    sampled users: they are NOT covered by the guarantee (the engine writes them only with
    training.debug_step_log); keep them private. `update_norm` and `update_signal_norm` are post-processing of
    the noisy update (covered). With adaptive clipping (privacy.clipping: adaptive) `clip_norm` is the step's
    C_t and `unclipped_fraction_noisy` the fraction its noisy count released (covered); None otherwise.
    """

    step: int
    loss: float
    learning_rate: float
    realised_units: int
    realised_examples: int
    realised_users: int
    clipped_fraction: float
    mean_unit_norm: float
    update_norm: float
    update_signal_norm: float
    seconds: float
    clip_norm: float | None = None
    unclipped_fraction_noisy: float | None = None

    @classmethod
    def of(cls, row: dict[str, Any]) -> "StepStats":
        return cls(**{f.name: row.get(f.name) for f in dataclasses.fields(cls)})


def _names(model: torch.nn.Module, params: list[torch.Tensor], limit: int = 4) -> str:
    ids = {id(p) for p in params}
    names = [n for n, p in model.named_parameters() if id(p) in ids]
    shown = ", ".join(names[:limit]) or f"{len(params)} tensor(s) that are not parameters of the model"
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ConfigError unless `optimizer` updates exactly the model's trainable parameters, each once."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer is a {type(optimizer).__name__}; give a torch.optim.Optimizer over the model's "
                          "trainable parameters, e.g. torch.optim.AdamW([p for p in model.parameters() if "
                          "p.requires_grad], lr=1e-3).")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters (requires_grad): nothing would train. Unfreeze "
                          "the layers to train, or wrap the model with peft's get_peft_model.")
    in_opt = [p for group in optimizer.param_groups for p in group["params"]]
    want, have = {id(p) for p in trainable}, {id(p) for p in in_opt}
    missing = [p for p in trainable if id(p) not in have]
    extra = [p for p in in_opt if id(p) not in want]
    if missing:
        raise ConfigError(f"the optimizer does not update {len(missing)} of the model's {len(trainable)} trainable "
                          f"parameters ({_names(model, missing)}): they would get clipping and noise but no update. "
                          "Build the optimizer over [p for p in model.parameters() if p.requires_grad], or freeze "
                          "those parameters (requires_grad=False) before make_private.")
    if extra:
        raise ConfigError(f"the optimizer updates {len(extra)} tensor(s) that are not trainable parameters of the "
                          f"model ({_names(model, extra)}): frozen or foreign parameters that no clipping or noise "
                          "covers. Build the optimizer over [p for p in model.parameters() if p.requires_grad].")
    if len(in_opt) != len(have):
        raise ConfigError("the optimizer lists a parameter more than once (in two parameter groups); each must be in "
                          "exactly one group.")


def check_no_gradients(model: torch.nn.Module, when: str) -> None:
    """ConfigError when a trainable parameter holds a gradient `when` (before make_private / a step)."""
    held = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    if held:
        raise ConfigError(f"{len(held)} trainable parameter(s) already hold a gradient {when} "
                          f"({_names(model, held)}): a backward() ran outside the DP step. The DP step computes the "
                          "clipped, noised gradient itself and would overwrite it; remove the loss.backward() from "
                          "your loop (optimizer.zero_grad(set_to_none=True) clears what is there).")


class PrivateTraining:
    """The user-level DP training of a model with its optimizer: `step()` runs one noisy step of the plan `spec`.

    Built by `userdp.make_private` (which plans the mechanism and bounds the data to G); at this level the
    inputs are the engine's: the bounded `pool`, a calibrated `spec`, `settings` (sequence length, physical
    batch, device, precision), the run's `seeds` (run_seeds.run_seeds; with secret=True the sampler and noise
    seeds are fresh OS entropy, never written) and the tokenizer's pad id. `observe` is the engine's
    observation hook (tests and audits); `gradient_source` and `compute_epsilon` as in engine.train.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, pool: TrainingPool,
                 spec: RunSpec, settings: TrainSettings, seeds: dict[str, Any], pad_id: int, *,
                 scheduler: Any = None, observe: Callable[[step.StepObservation], None] | None = None,
                 gradient_source: Any = None, compute_epsilon: Callable[..., float] | None = None,
                 dist: Any = None) -> None:
        check_optimizer(model, optimizer)
        check_no_gradients(model, "before make_private")
        hook = step.Observer(observe) if observe is not None else None
        self._run = engine.setup(model, pool, RunSpec.from_record(spec), settings, None, seeds, pad_id, dist,
                                 gradient_source, hook, optimizer=optimizer, scheduler=scheduler)
        # As engine.train's start: torch's global RNG (dropout) from the run's torch seed, so a run of the same
        # inputs and seeds gives the same model whichever client drives it (it is not part of the mechanism).
        torch.manual_seed(self._run.seeds["torch"])
        self._placed = next(model.parameters()).device  # where setup put it ("cuda" resolves to "cuda:0")
        self._trainable = [id(p) for p in self._run.state.params]
        self._compute_epsilon = compute_epsilon
        self._epsilon_at: dict[int, float] = {}

    # ------------------------------------------------------------------ views
    @property
    def engine_run(self) -> "engine.Run":
        """The engine's run (state, context, step): what UserDPTrainer drives one step at a time."""
        return self._run

    @property
    def spec(self) -> RunSpec:
        """The plan: method, epsilon, delta, group_size G, sampling_rate q, steps T, noise_multiplier, clip_norm."""
        return self._run.ctx.spec

    @property
    def model(self) -> torch.nn.Module:
        return self._run.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._run.state.optimizer

    @property
    def steps_done(self) -> int:
        return int(self._run.state.step)

    @property
    def device(self) -> torch.device:
        return self._placed

    @property
    def pool(self) -> TrainingPool:
        """The user-bounded training pool (rows of each user, at most G; map StepObservation rows to users with
        pool.example_user and pool.user_ids)."""
        return self._run.ctx.pool

    @property
    def delta(self) -> float:
        return float(self.spec.delta)

    @property
    def epsilon(self) -> float:
        """The guarantee of the model as it is now, at `delta`: the event of the steps taken so far (T after the
        last step), with the DP contribution statistics when the plan spent budget on them; inf without noise.
        The same computation as the ledger's `epsilon` (`ledger.guarantee_epsilon`)."""
        done = self.steps_done
        if done not in self._epsilon_at:
            if not self.spec.private:
                value = math.inf
            elif done == 0 and not self.spec.contribution_stats:
                value = 0.0  # nothing released yet
            else:
                value = guarantee_epsilon([self.spec.event_of_steps(done)], self.spec.delta,
                                          self.spec.contribution_stats, self._compute_epsilon)
            self._epsilon_at[done] = value
        return self._epsilon_at[done]

    # ------------------------------------------------------------------ the step
    def check(self) -> None:
        """Refuse (ConfigError) what would make the next step run another mechanism than the one accounted."""
        state, ctx = self._run.state, self._run.ctx
        if state.step >= ctx.mech.steps:
            raise PrivacyError(f"all {ctx.mech.steps} planned steps ran; the accountant covered exactly these "
                               f"(epsilon {self.epsilon:.4g}). Another step would spend more than the plan: build a "
                               "new make_private with more steps (the same epsilon then gets more noise).")
        model = state.model
        moved = sorted({str(p.device) for p in model.parameters() if p.device != self._placed})
        if moved:
            raise ConfigError(f"the model was moved to {', '.join(moved)} after make_private placed it on "
                              f"{self._placed}: the noise generator, the optimizer's state and the batches stay on "
                              f"{self._placed} (silent corruption, as in opacus#820). Move the model before "
                              "make_private (or pass options=TrainingOptions(device=...)) and build it again.")
        now = [id(p) for p in model.parameters() if p.requires_grad]
        if now != self._trainable:
            raise ConfigError("the model's trainable parameters changed after make_private (a layer was frozen or "
                              "unfrozen, or adapters added): the clipping hooks and the optimizer cover the old "
                              "set. Call make_private again after changing what trains.")
        check_optimizer(model, self.optimizer)
        check_no_gradients(model, "before dp.step()")

    def step(self) -> StepStats:
        """One noisy step: Poisson sample, clip per unit, noise once, divide by the expected batch,
        optimizer.step() (and the scheduler's, if given); p.grad is then cleared. Its StepStats."""
        self.check()
        row = self._run.advance()
        for p in self._run.state.params:
            p.grad = None
        return StepStats.of(row)

    # ------------------------------------------------------------------ release
    def ledger(self) -> dict[str, Any]:
        """The ledger of the model as it is now (what ran: the steps taken so far, and its guarantee)."""
        return build_ledger(self.spec, engine.run_facts(self._run), self._compute_epsilon)

    def save(self, output_dir: str | Path) -> Path:
        """Release the model into `output_dir` (created if missing): model/ (the adapter of a PeftModel, else the
        whole model), ledger.json, train_log.parquet, plan.json and the README.md model card; the folder.

        Saving before the last step releases a model of the steps taken so far; its ledger says so
        (complete false) and its epsilon is theirs.
        """
        from ..layout import PLAN_FILE

        out = Path(output_dir).expanduser().resolve()
        if out.exists() and not out.is_dir():
            raise ConfigError(f"output_dir {output_dir} is a file; give a folder (it is created if missing).")
        out.mkdir(parents=True, exist_ok=True)
        engine.write_release(self._run, run_state.RunPaths(out), self._compute_epsilon)
        self.spec.write(out / PLAN_FILE)
        return out

    # ------------------------------------------------------------------ state (for checkpoints)
    def state_dict(self) -> dict[str, Any]:
        """Everything the next steps depend on (model's trainable tensors, optimizer, sampler and noise streams,
        counters, log): it holds the SECRET sampling and noise state, so store it only where the training data
        may be (mode 0600) and delete it when the run is released."""
        return self._run.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._run.state.load_state_dict(state)
