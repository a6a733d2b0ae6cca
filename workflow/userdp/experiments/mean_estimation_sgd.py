"""Vectorised DP-SGD for the quadratic loss 0.5 ||theta - x||^2 (docs/method.md sections 3, 4, 9).

The gradient of the loss at a point x is theta - x, so both methods are the
same loop over different points:
- DP-SGD-ELS samples the bounded pool's EXAMPLES (Poisson, rate q) and clips
  each example's gradient theta - x_i;
- DP-SGD-ULS samples USERS (Poisson, rate q_u); a user's gradient is the
  average of its kept examples' gradients, theta - mean_u, clipped once.
Per step: noisy sum S = sum_i clip(g_i) + N(0, sigma^2 C^2 I), update
theta <- theta - lr * S / E[batch] with the EXPECTED batch (examples for ELS,
users for ULS), never the realised one.

Several learning rates run side by side: theta has shape (L, d) and every
learning rate sees the same sampled batches and the same noise draws (each
is still an exact DP-SGD run; sharing the randomness only makes the rates
easier to compare). Clipping is done without forming (L, batch, d) arrays:
||theta_l - x_i||^2 = ||theta_l||^2 - 2 theta_l . x_i + ||x_i||^2, and the
clipped sum is theta_l * sum_i f_li - sum_i f_li x_i, two small matrix
products per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def poisson_indices(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Indices of a Poisson sample of range(n): each kept independently with prob. `rate`.

    Drawn as geometric gaps between successive kept indices, which is exactly
    a Bernoulli(rate) process but costs O(n * rate) rather than O(n).
    """
    if rate <= 0 or n <= 0:
        return np.empty(0, dtype=np.int64)
    if rate >= 1:
        return np.arange(n, dtype=np.int64)
    mean = n * rate
    chunk = int(mean + 6.0 * math.sqrt(mean) + 16)
    parts = [np.cumsum(rng.geometric(rate, size=chunk)) - 1]
    # Rarely the chunk ends before n: continue the same process from there.
    while parts[-1][-1] < n - 1:
        parts.append(parts[-1][-1] + np.cumsum(rng.geometric(rate, size=chunk)))
    positions = np.concatenate(parts)
    return positions[positions < n].astype(np.int64)


@dataclass(frozen=True)
class DpSgdResult:
    """Final iterates, shape (noise levels, learning rates, d), and the realised batch sizes."""

    theta: np.ndarray
    batch_sizes: np.ndarray
    realised_compute: int


def clipped_noisy_gd(
    points: np.ndarray,
    *,
    sampling_rate: float,
    noise_multipliers: Sequence[float],
    clip_norm: float,
    expected_batch: float,
    steps: int,
    learning_rates: Sequence[float],
    rng_sample: np.random.Generator,
    rng_noise: np.random.Generator,
    compute_per_point: np.ndarray | None = None,
) -> DpSgdResult:
    """DP-SGD from theta = 0 on the loss 0.5 ||theta - p||^2 over Poisson-sampled `points`.

    Runs every (noise multiplier, learning rate) pair side by side: cells that
    differ only in epsilon share the sampling rate (it depends on K, T and G
    only), so they share the sampled batches too, and the noise of a run with
    multiplier sigma is sigma * C * z with z drawn once per step. Each pair is
    an exact DP-SGD run; sharing randomness across pairs only makes their
    comparison less noisy (common random numbers).

    clip_norm may be math.inf (no clipping) and a multiplier 0 (no noise),
    e.g. for tests. `compute_per_point` counts the per-example gradient
    evaluations one sampled point costs (1 for an example, m_u for a user);
    the total is returned as `realised_compute`.
    """
    points = np.asarray(points, dtype=np.float64)
    n, d = points.shape
    sig = np.asarray(noise_multipliers, dtype=np.float64).reshape(-1)
    lrs = np.asarray(learning_rates, dtype=np.float64).reshape(-1)
    n_sig, n_lr = sig.size, lrs.size
    # Rows of theta: every (sigma, lr) pair, sigma-major.
    noise_scale = (np.repeat(sig, n_lr) * float(clip_norm) if math.isfinite(clip_norm) else np.zeros(sig.size * n_lr))
    if not math.isfinite(clip_norm) and np.any(sig > 0):
        raise ValueError("noise needs a finite clip norm (its std is sigma * C)")
    step_size = (np.tile(lrs, n_sig) / float(expected_batch))[:, None]
    theta = np.zeros((n_sig * n_lr, d))
    sq_norms = np.einsum("ij,ij->i", points, points)
    clipping = math.isfinite(clip_norm)
    any_noise = bool(np.any(noise_scale > 0))
    sizes = np.empty(steps, dtype=np.int64)
    compute = 0
    for t in range(steps):
        idx = poisson_indices(rng_sample, n, sampling_rate)
        sizes[t] = idx.size
        compute += int(compute_per_point[idx].sum()) if compute_per_point is not None else idx.size
        batch = points[idx]  # (b, d)
        if clipping:
            # ||theta_r - x_i|| for every row r and sampled point i, then the
            # clipped sum sum_i f_ri (theta_r - x_i), without (rows, b, d) arrays.
            sq = sq_norms[idx, None] - 2.0 * (batch @ theta.T) + np.einsum("rd,rd->r", theta, theta)[None, :]
            factor = np.minimum(1.0, clip_norm / np.sqrt(np.maximum(sq, 1e-300)))  # (b, rows)
            total = theta * factor.sum(0)[:, None] - factor.T @ batch
        else:
            total = theta * idx.size - batch.sum(0)[None, :]
        if any_noise:
            # Fresh noise every step: N(0, sigma^2 C^2 I) for each row's sigma.
            total = total + noise_scale[:, None] * rng_noise.standard_normal(d)[None, :]
        theta = theta - step_size * total
    return DpSgdResult(theta=theta.reshape(n_sig, n_lr, d), batch_sizes=sizes, realised_compute=compute)


def run_els(pool, **kwargs) -> DpSgdResult:
    """DP-SGD-ELS on a BoundedPool: Poisson over examples, per-example clipping."""
    return clipped_noisy_gd(pool.examples, **kwargs)


def run_uls(pool, **kwargs) -> DpSgdResult:
    """DP-SGD-ULS on a BoundedPool: Poisson over users, clip each user's average gradient."""
    return clipped_noisy_gd(pool.user_means, compute_per_point=pool.kept, **kwargs)
