"""Optimizers (Adam, SGD, Adafactor) and learning-rate schedules with warmup.

The optimizer consumes the already privatised update direction (noisy sum /
expected batch size); it never sees per-example data, so any optimizer is
post-processing and privacy is unaffected.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..errors import ConfigError

OPTIMIZERS = ("adam", "sgd", "adafactor")
SCHEDULES = ("constant", "linear", "cosine")


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """Build the optimizer `name` (training.optimizer) with learning rate `lr`."""
    params = list(params)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # A fixed external learning rate (the swept one), not Adafactor's relative step.
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    raise ConfigError(f"training.optimizer is {name!r}; allowed values: {list(OPTIMIZERS)}.")


class LRMultiplier:
    """Multiplier of the base learning rate at a step: linear warmup, then the schedule.

    A callable object (not a lambda) so LambdaLR can save it in its state dict.
    """

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int):
        if schedule not in SCHEDULES:
            raise ConfigError(f"training.schedule is {schedule!r}; allowed values: {list(SCHEDULES)}.")
        self.schedule, self.warmup_steps, self.total_steps = schedule, int(warmup_steps), int(total_steps)

    def __call__(self, step: int) -> float:
        # `step` counts completed optimizer steps; the update of step t+1 uses multiplier(t).
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        if self.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `total_steps` steps (training.schedule, training.warmup_steps)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRMultiplier(schedule, warmup_steps, total_steps))
