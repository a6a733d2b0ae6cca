"""User-level DP-FTRL with banded correlated noise (BandMF) and cyclic Poisson sampling, for ULS.

The matrix-mechanism view of DP-FTRL (Denisov et al. 2022; Choquette-Choo et
al., "(Amplified) Banded Matrix Factorization", arXiv 2306.08153): the T
released gradients are x + sigma C^-1 z, with x_t the step's clipped sum
(one user, clipped to the clip norm, is one unit), z ~ N(0, I) per step and
coordinate, and C a lower-triangular Toeplitz strategy matrix with b bands
(c_0, ..., c_{b-1} on its diagonals, 0 below). Step t's noise is therefore

    w_t = (z_t - sum_{k=1}^{b-1} c_k w_{t-k}) / c_0,

which needs the b - 1 previous w's of every trainable coordinate (the "noise
buffers"). Any optimizer then post-processes the released gradients; the
anti-correlated noise cancels in their running sums (what SGD's parameters
are), which is where the gain over DP-SGD's independent noise comes from.

Strategy: the banded square root of the prefix-sum matrix (Kalinin and
Lampert 2024, "BSR"): c_k = binom(2k, k) / 4^k, the Taylor coefficients of
(1 - x)^(-1/2), kept for k < b and scaled to unit L2 norm so that every
column of C has norm at most 1. It needs no optimisation and is near-optimal
for prefix sums; b = 1 is DP-SGD.

Sampling and accounting: each user belongs to one of b partitions (a keyed
hash of its id, independent of every other user, so adding or removing a user
moves no one else: training.sampling.CyclicPoissonSampler); step t samples
only partition t mod b, each of its users with probability p. A user then
takes part at most once in any b consecutive steps, so its contributions
reach disjoint row blocks of C x (C is b-banded) and, whitened by C, the run
is ceil(T / b) adaptively composed Poisson-subsampled Gaussian mechanisms at
noise multiplier sigma / (max column norm of C) = sigma (Choquette-Choo et
al. 2023, Theorem 4; jax_privacy's `amplified_bandmf_event`). The expected
batch is p N / b users, so a budget's batch m gives p = b m / N (<= 1: the
plan refuses larger batches for b).

ELS is not covered: a user's examples fall in different steps of a cycle,
which the amplified-BandMF analysis above does not bound (ELS cells stay
DP-SGD whatever privacy.correlated_noise says).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from ..errors import PrivacyError

#: The only strategy so far: the banded square root of the prefix-sum matrix.
BANDED_SQUARE_ROOT = "banded_square_root"
STRATEGIES = (BANDED_SQUARE_ROOT,)
#: The keys of privacy.correlated_noise (and of the plan's and ledger's `correlated_noise`).
KEYS = ("strategy", "bands")
#: Where the config keeps it.
KEY = "privacy.correlated_noise"


def bsr_coefficients(bands: int) -> np.ndarray:
    """c_0..c_{b-1} of the banded square root strategy, scaled to unit L2 norm (float64)."""
    b = int(bands)
    if b < 1:
        raise PrivacyError(f"{KEY}.bands is {bands}; give a whole number >= 1 (1: DP-SGD).")
    c = np.empty(b, np.float64)
    c[0] = 1.0
    for k in range(1, b):  # binom(2k, k) / 4^k = prod_{j<=k} (2j - 1) / (2j)
        c[k] = c[k - 1] * (2 * k - 1) / (2 * k)
    return c / np.linalg.norm(c)


def strategy_matrix(coefficients: np.ndarray, steps: int) -> np.ndarray:
    """The T x T lower-triangular banded Toeplitz matrix C (dense: for tests and the audit's small T)."""
    c = np.asarray(coefficients, np.float64)
    out = np.zeros((int(steps), int(steps)), np.float64)
    for k, ck in enumerate(c[: int(steps)]):
        out += np.diag(np.full(int(steps) - k, ck), -k)
    return out


def whiten(released: np.ndarray, coefficients: np.ndarray, axis: int = 0) -> np.ndarray:
    """C y along `axis` (the steps): sum_k c_k y_{t-k}; whitens noise C^-1 z back to z."""
    y = np.moveaxis(np.asarray(released, np.float64), axis, 0)
    out = np.zeros_like(y)
    for k, ck in enumerate(np.asarray(coefficients, np.float64)):
        if k >= y.shape[0]:
            break
        out[k:] += ck * y[: y.shape[0] - k]
    return np.moveaxis(out, 0, axis)


def marginal_std_factors(coefficients: np.ndarray, steps: int) -> np.ndarray:
    """||row t of C^-1|| for t < steps: step t's noise std over sigma C (it grows with t to a limit)."""
    c = np.asarray(coefficients, np.float64)
    # the first column of C^-1 (Toeplitz too): r_0 = 1 / c_0, r_t = -(sum_{k=1}^{min(t, b-1)} c_k r_{t-k}) / c_0
    r = np.zeros(int(steps), np.float64)
    for t in range(int(steps)):
        acc = 1.0 if t == 0 else 0.0
        for k in range(1, min(t, c.size - 1) + 1):
            acc -= c[k] * r[t - k]
        r[t] = acc / c[0]
    return np.sqrt(np.cumsum(r ** 2))


def rounds(steps: int, bands: int) -> int:
    """ceil(T / b): the most steps one user takes part in, the compositions the accountant counts."""
    return -(-int(steps) // int(bands))


@dataclasses.dataclass(frozen=True)
class CorrelatedNoise:
    """privacy.correlated_noise: the strategy and its number of bands b (b >= 2; b = 1 is plain DP-SGD)."""

    bands: int
    strategy: str = BANDED_SQUARE_ROOT

    def __post_init__(self) -> None:
        if isinstance(self.bands, bool) or not isinstance(self.bands, (int, np.integer)) or self.bands < 2:
            raise PrivacyError(f"{KEY}.bands is {self.bands!r}; give a whole number >= 2 (the number of bands b: a "
                               f"user takes part at most once in b steps), or set {KEY} to null for DP-SGD.")
        if self.strategy not in STRATEGIES:
            raise PrivacyError(f"{KEY}.strategy is {self.strategy!r}; allowed: {', '.join(STRATEGIES)}.")

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "CorrelatedNoise":
        """From privacy.correlated_noise (or a plan's or ledger's `correlated_noise`)."""
        if not isinstance(record, Mapping):
            raise PrivacyError(f"{KEY} is {record!r}; give a mapping such as {{bands: 4}}, or null.")
        unknown = sorted(set(record) - set(KEYS))
        if unknown:
            raise PrivacyError(f"{KEY} has unknown key(s) {unknown}; allowed: {', '.join(KEYS)}.")
        if "bands" not in record:
            raise PrivacyError(f"{KEY} has no `bands`; give the number of bands b >= 2, e.g. {{bands: 4}}.")
        return cls(**dict(record))

    def record(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "bands": int(self.bands)}

    @property
    def coefficients(self) -> np.ndarray:
        return bsr_coefficients(self.bands)

    def buffer_bytes(self, n_coordinates: int, bytes_per_value: int = 4) -> int:
        """Memory of the b - 1 noise buffers of `n_coordinates` trainable coordinates."""
        return (int(self.bands) - 1) * int(n_coordinates) * int(bytes_per_value)

    def check_fits(self, n_coordinates: int, max_gb: float, where: str = "this run") -> None:
        """PrivacyError naming training.max_noise_buffers_gb when the buffers would not fit in it."""
        need = self.buffer_bytes(n_coordinates) / 1e9
        if need > float(max_gb):
            most = int(float(max_gb) * 1e9 // (4 * max(int(n_coordinates), 1))) + 1
            fewer = f"use at most {most} bands" if most >= 2 else f"set {KEY} to null (DP-SGD)"
            raise PrivacyError(
                f"{where}: {KEY}.bands = {self.bands} keeps {self.bands - 1} noise buffers of the {n_coordinates:,} "
                f"trainable coordinates, {need:.3g} GB, above training.max_noise_buffers_gb = {float(max_gb):g}. "
                f"Fix: {fewer}, train fewer coordinates (LoRA: model.lora), or raise training.max_noise_buffers_gb.")


def of_config(privacy: Mapping[str, Any], method: str) -> CorrelatedNoise | None:
    """The correlated noise a `method` cell of privacy.* runs: None for ELS, or when the key is null."""
    record = privacy.get("correlated_noise")
    if record is None or method != "uls":
        return None
    return CorrelatedNoise.from_record(record)


def check_rate(sampling_rate: float, bands: int, where: str) -> None:
    """PrivacyError when cyclic sampling's per-partition rate p = b m / N exceeds 1."""
    if sampling_rate > 1:
        raise PrivacyError(
            f"{where}: with {KEY}.bands = {bands} a step samples from one partition of about N / {bands} users, "
            f"at rate p = b m / N = {sampling_rate:.4g} > 1. Use fewer bands, more steps for this budget in "
            "grid.budgets (smaller batches), or a smaller compute budget.")

