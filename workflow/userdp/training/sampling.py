"""Poisson sampling of examples (ELS) or users (ULS), with a saveable RNG state.

The accountant assumes Poisson subsampling: at every step each unit (an
example of the bounded pool for ELS, a train user for ULS) is included
independently with probability q. Realised batch sizes therefore vary from
step to step (Binomial(N, q)); this module never "fixes" that with
shuffling or fixed-size batches, which would change the mechanism and void
the privacy accounting.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PoissonSampler:
    """Include each of `n_units` units independently with probability `rate`.

    One Bernoulli draw per unit per step, from a numpy PCG64 generator whose
    state is part of the training checkpoint, so a resumed run draws exactly
    the batches an uninterrupted run would.
    """

    def __init__(self, n_units: int, rate: float, seed: int):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"sampling rate must be in [0, 1], got {rate}")
        self.n_units = int(n_units)
        self.rate = float(rate)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    @property
    def expected_size(self) -> float:
        """q * N: the public constant the noisy sum is divided by."""
        return self.rate * self.n_units

    def sample(self) -> np.ndarray:
        """Indices (sorted, int64) of the units included in this step."""
        return np.flatnonzero(self.rng.random(self.n_units) < self.rate).astype(np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"n_units": self.n_units, "rate": self.rate, "bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["n_units"]) != self.n_units or float(state["rate"]) != self.rate:
            raise ValueError("sampler state belongs to a different pool or sampling rate")
        self.rng.bit_generator.state = state["bit_generator"]
