"""Optimizers (Adam, DP-AdamBC, SGD, Adafactor) and learning-rate schedules with warmup.

The optimizer consumes the already privatised update direction (noisy sum /
expected batch size); it never sees per-example data, so any optimizer is
post-processing and privacy is unaffected. DP-AdamBC (Tang, Shpilevskiy and
Lecuyer, AAAI 2024, arXiv 2312.14334) reads one more public constant: the
per-coordinate standard deviation of the noise in that update, sigma C / (q N).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from ..errors import ConfigError


#: DP-AdamBC's floor gamma' on the corrected second moment (a variance, so sqrt(1e-8) = 1e-4 bounds the
#: denominator), the value of the paper's experiments.
ADAM_BC_FLOOR = 1e-8


class AdamBC(torch.optim.Optimizer):
    """DP-Adam with the bias of the noise removed from the second moment (DP-AdamBC).

    With the privatised update g (noisy clipped sum / expected batch, whose noise has per-coordinate variance
    Phi = noise_std^2), for step t = 1, 2, ...:

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t);  v_hat = v / (1 - b2^t)
        theta -= lr * m_hat / sqrt(max(v_hat - Phi, floor))

    Plain DP-Adam's v_hat estimates E[g^2] = signal^2 + Phi: the noise dominates the denominator and Adam
    degenerates to scaled DP-SGD; subtracting Phi restores Adam's per-coordinate scaling. When the noise's
    variance changes from step to step (`bind_noise(..., varying=True)`: adaptive clipping moves C, banded
    DP-FTRL's marginal noise differs by step), v_hat holds the same exponential average of the steps'
    variances, so the subtracted term is that average, Phi_avg = b2 Phi_avg + (1 - b2) Phi_t, over
    (1 - b2^t) (equal to Phi when it is constant; the constant case computes Phi itself). noise_std None:
    not known yet (the run binds it from the plan, sigma C / (q N): the pipeline, make_private and the
    trainers do). Post-processing: no privacy cost.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 noise_std: float | None = None, floor: float = ADAM_BC_FLOOR):
        if not lr >= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ConfigError(f"AdamBC: lr {lr} must be >= 0 and betas {betas} in [0, 1).")
        if not floor > 0:
            raise ConfigError(f"AdamBC: floor is {floor}; it must be > 0 (it bounds the denominator).")
        if noise_std is not None and not noise_std >= 0:
            raise ConfigError(f"AdamBC: noise_std is {noise_std}; give sigma * C / (expected batch) >= 0.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "floor": float(floor)})
        self.noise_std = None if noise_std is None else float(noise_std)
        self.noise_varies = False  # set by the run under adaptive clipping: the noise then changes every step

    def bind_noise(self, noise_std: float, varying: bool = False) -> None:
        """Take the run's per-coordinate update noise (the engine calls this, every step with `varying`: adaptive
        clipping); a different one set before, other than by the run itself with `varying`, is a ConfigError (the
        correction would subtract another variance than the noise's)."""
        noise_std = float(noise_std)
        if self.noise_std is not None and not self.noise_varies and not _same_noise(self.noise_std, noise_std):
            raise ConfigError(f"AdamBC.noise_std is {self.noise_std}, but the noise in this run's update has "
                              f"standard deviation {noise_std} (sigma C / q N of the plan): leave noise_std unset "
                              "(None) and the run sets it.")
        self.noise_std, self.noise_varies = noise_std, bool(varying)

    @torch.no_grad()
    def step(self, closure=None):
        if self.noise_std is None:
            raise ConfigError("AdamBC.noise_std is not set: give noise_std=sigma * C / (expected batch), or pass "
                              "the optimizer to userdp.make_private, which sets it from the plan.")
        loss = None if closure is None else closure()
        phi = self.noise_std ** 2
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                if self.noise_varies:  # v's noise part is the b2-average of the steps' variances
                    state["noise_var_avg"] = b2 * state.get("noise_var_avg", 0.0) + (1 - b2) * phi
                    noise_var = state["noise_var_avg"] / (1 - b2 ** t)
                else:
                    noise_var = phi
                corrected = (v / (1 - b2 ** t)).sub_(noise_var).clamp_(min=group["floor"])
                p.addcdiv_(m, corrected.sqrt_(), value=-group["lr"] / (1 - b1 ** t))
        return loss

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["noise_std"] = self.noise_std
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("noise_std", None)
        # a varying noise was saved at the checkpoint's step; the run binds the next step's
        if saved is not None and self.noise_std is not None and not self.noise_varies \
                and not _same_noise(saved, self.noise_std):
            raise ConfigError(f"AdamBC: the checkpoint's noise_std {saved} is not this run's {self.noise_std}; "
                              "resume with the same plan.")
        super().load_state_dict(state_dict)


def _same_noise(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-12)


def _adafactor(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # A fixed external learning rate (the swept one), not Adafactor's relative step.
    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


#: training.optimizer: name -> factory(parameters, learning rate). The config
#: schema's enum lists the same names (tests/test_registries.py checks).
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer]] = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    # its noise is the run's: run_state.RunState binds it (AdamBC.bind_noise)
    "adam_bc": lambda params, lr: AdamBC(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "adafactor": _adafactor,
}

#: training.schedule: name -> multiplier of the base learning rate at a
#: progress in [0, 1] after warmup. The schema's enum lists the same names.
SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """Build the optimizer `name` (training.optimizer) with learning rate `lr` (adam_bc's noise: bound by the
    run, `AdamBC.bind_noise`)."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"training.optimizer is {name!r}; allowed values: {list(OPTIMIZERS)}.")
    return OPTIMIZERS[name](list(params), lr)


class LRMultiplier:
    """Multiplier of the base learning rate at a step: linear warmup, then the schedule.

    A callable object (not a lambda) so LambdaLR can save it in its state
    dict; it holds the schedule's name, looked up in SCHEDULES when called.
    """

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int):
        if schedule not in SCHEDULES:
            raise ConfigError(f"training.schedule is {schedule!r}; allowed values: {list(SCHEDULES)}.")
        self.schedule, self.warmup_steps, self.total_steps = schedule, int(warmup_steps), int(total_steps)

    def __call__(self, step: int) -> float:
        # `step` counts completed optimizer steps; the update of step t+1 uses multiplier(t).
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        return SCHEDULES[self.schedule](progress)


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `total_steps` steps (training.schedule, training.warmup_steps)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRMultiplier(schedule, warmup_steps, total_steps))
