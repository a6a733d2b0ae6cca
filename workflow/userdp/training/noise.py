"""Gaussian noise for the summed clipped gradient, from a dedicated generator.

Noise N(0, (sigma * C)^2) is added once per step to every coordinate of the
summed clipped gradient (before the division by the expected batch size).
It comes from its own seeded torch generator, separate from sampling and
from torch's global RNG, so that its state can be checkpointed and a resumed
run draws the same noise an uninterrupted run would. Tied parameters (GPT-2's
shared embedding) appear once in `model.parameters()` and so get one noise
draw, as they are one coordinate of the mechanism.

A seeded PRNG is right for a reproducible study; a deployment that must
resist an adversary predicting the noise should seed it from a secure source.
"""

from __future__ import annotations

from typing import Iterable

import torch


class GaussianNoise:
    """Adds N(0, (noise_multiplier * clip_norm)^2) to each gradient coordinate."""

    def __init__(self, noise_multiplier: float, clip_norm: float | None, seed: int, device: torch.device | str = "cpu"):
        self.noise_multiplier = float(noise_multiplier)
        self.clip_norm = clip_norm
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))

    @property
    def std(self) -> float:
        if self.noise_multiplier == 0.0 or self.clip_norm is None:
            return 0.0
        return self.noise_multiplier * float(self.clip_norm)

    def add_(self, params: Iterable[torch.nn.Parameter], record: list[torch.Tensor] | None = None) -> None:
        """Add fresh noise to `p.grad` of every parameter (grads must exist).

        record: when a list, the noise added to each parameter (std times the draw, in p.grad's dtype) is
        appended to it (the engine's observation hook); None copies nothing.
        """
        std = self.std
        if std == 0.0:
            return
        for p in params:
            noise = torch.randn(p.shape, generator=self.generator, device=self.device, dtype=torch.float32)
            noise = noise.to(device=p.grad.device, dtype=p.grad.dtype)
            p.grad.add_(noise, alpha=std)
            if record is not None:
                record.append(noise.mul_(std))

    def draw(self, std: float) -> float:
        """One scalar N(0, std^2) from the same generator (adaptive clipping's count, after the step's gradient
        noise: checkpointed and, with secret seeds, secret with it)."""
        return float(torch.randn((), generator=self.generator, device=self.device, dtype=torch.float64)) * float(std)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "std": self.std}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"].cpu() if hasattr(state["generator"], "cpu") else state["generator"])
