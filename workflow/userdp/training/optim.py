"""Optimizers (Adam, SGD, Adafactor) and learning-rate schedules with warmup.

The optimizer consumes the already privatised update direction (noisy sum /
expected batch size); it never sees per-example data, so any optimizer is
post-processing and privacy is unaffected.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from ..errors import ConfigError


def _adam(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _sgd(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def _adafactor(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # A fixed external learning rate (the swept one), not Adafactor's relative step.
    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


#: training.optimizer: name -> factory(parameters, learning rate). The config
#: schema's enum lists the same names (tests/test_registries.py checks).
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer]] = {
    "adam": _adam,
    "sgd": _sgd,
    "adafactor": _adafactor,
}


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


#: training.schedule: name -> multiplier of the base learning rate at a
#: progress in [0, 1] after warmup. The schema's enum lists the same names.
SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """Build the optimizer `name` (training.optimizer) with learning rate `lr`."""
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
