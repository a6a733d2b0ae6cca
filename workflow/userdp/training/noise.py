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

    def step_std(self, step: int) -> float:
        """The std of each coordinate of step `step`'s noise (0-based; = std here, banded noise: larger). A function
        of the public step index, so every rank of a process group gets the same value (only rank 0 draws)."""
        return self.std

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


class BandedNoise(GaussianNoise):
    """Banded DP-FTRL's correlated noise (userdp.privacy.banded): step t adds std * w_t to each coordinate, with

        w_t = (z_t - sum_{k=1}^{b-1} c_k w_{t-k}) / c_0,   z_t ~ N(0, I) from the same generator as GaussianNoise,

    i.e. the noise sequence is std * C^-1 z for the b-banded Toeplitz strategy C. The b - 1 previous w's of every
    trainable coordinate are kept (`buffers`, float32 on the noise's device, in the checkpoint: they are as secret
    as the generator). std follows the clip norm of the step (adaptive clipping), w does not depend on it.
    steps: the run's T (the marginal stds ||row t of C^-1|| are computed once for them).
    """

    def __init__(self, noise_multiplier: float, clip_norm: float | None, seed: int, coefficients, steps: int,
                 device: torch.device | str = "cpu"):
        from ..privacy.banded import marginal_std_factors

        super().__init__(noise_multiplier, clip_norm, seed, device)
        self.coefficients = [float(c) for c in coefficients]
        self.buffers: list[list[torch.Tensor]] = []  # newest first: buffers[k - 1] holds w_{t-k}, per parameter
        self._row_norms = [float(r) for r in marginal_std_factors(self.coefficients, max(int(steps), 1))]

    def step_std(self, step: int) -> float:
        """Step t's per-coordinate std: std ||row t of C^-1|| (t < T, the run's steps)."""
        return self.std * self._row_norms[int(step)]

    def add_(self, params: Iterable[torch.nn.Parameter], record: list[torch.Tensor] | None = None) -> None:
        std = self.std
        if std == 0.0:
            return
        c = self.coefficients
        # A ring of b - 1 buffers: once full, w_t overwrites w_{t-b+1}, parameter by parameter, after its last use,
        # so the peak is the buffers plus one parameter's draw (what check_fits counts).
        full = len(c) > 1 and len(self.buffers) == len(c) - 1
        fresh: list[torch.Tensor] = []
        for i, p in enumerate(params):
            w = torch.randn(p.shape, generator=self.generator, device=self.device, dtype=torch.float32)
            for k, buf in enumerate(self.buffers, start=1):
                w.sub_(buf[i], alpha=c[k])
            w.div_(c[0])
            if full:
                w = self.buffers[-1][i].copy_(w)
            fresh.append(w)
            noise = w.to(device=p.grad.device, dtype=p.grad.dtype)
            p.grad.add_(noise, alpha=std)
            if record is not None:
                record.append(noise.mul(std))  # out of place: `noise` may be the buffer itself
        if len(c) > 1:
            self.buffers = [fresh] + self.buffers[: len(c) - 2]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "buffers": [[b.to("cpu", copy=True) for b in step] for step in self.buffers],
                "coefficients": list(self.coefficients)}

    def load_state_dict(self, state: dict) -> None:
        if [float(c) for c in state.get("coefficients", [])] != self.coefficients:
            raise ValueError("noise state belongs to another strategy (its band coefficients differ)")
        super().load_state_dict(state)
        # copies both ways: the ring overwrites its oldest buffer in place
        self.buffers = [[b.to(self.device, copy=True) for b in step] for step in state["buffers"]]
