"""Synthetic users for the mean-estimation study (docs/method.md section 9).

User u owns n_u examples; n_u is a discretised log-normal (heavy-tailed, like
posts per user). The population mean is a random unit vector mu; user means
are mu_u = mu + tau * xi_u and examples x_uj = mu_u + s * zeta_uj with
xi, zeta ~ N(0, I/d) (so ||xi|| is about 1 whatever d is). tau is the
inter-user spread, s the intra-user diversity.

Two seeds play different roles:
- the contribution counts n_u are drawn once from the config seed: they are the
  dataset's (public) shape, so the sampling rates and hence the noise
  calibration are the same for every replicate seed and are computed once;
- each replicate seed draws mu, xi and zeta. The diversity s only scales
  zeta, so one draw serves every s and every G (common random numbers make
  the comparisons across s, G and methods less noisy).

Contribution bounding keeps min(n_u, G) examples of each user. The examples
of a user are i.i.d. given mu_u, so keeping the first G of them IS a
uniformly random subset of size G; no extra shuffle is needed, and the pools
for different G are nested.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..seeding import derive_seed


def contribution_counts(n_users: int, median: float, sigma: float, seed: int) -> np.ndarray:
    """Examples per user: max(1, round(median * exp(sigma * z))), z ~ N(0, 1)."""
    if n_users < 1:
        raise ConfigError(f"mean_estimation.n_users is {n_users}; it must be at least 1.")
    rng = np.random.default_rng(derive_seed(seed, "mean_estimation", "contributions"))
    z = rng.standard_normal(n_users)
    return np.maximum(1, np.rint(median * np.exp(sigma * z))).astype(np.int64)


@dataclass(frozen=True)
class BoundedPool:
    """The data one method sees at one (diversity, G).

    examples: (N_G, d) every kept example (ELS samples these);
    user_means: (N, d) the average of each user's kept examples (ULS's
    per-user gradient theta - mean is the average of its examples' gradients);
    kept: (N,) m_u = min(n_u, G).
    """

    examples: np.ndarray
    user_means: np.ndarray
    kept: np.ndarray

    @property
    def pool_size(self) -> int:
        return int(self.kept.sum())


class Population:
    """One replicate of the synthetic users (mu, user offsets, example noise).

    `phase` ("report" or "tuning") keeps tuning replicates independent of
    report replicates even when their seed numbers coincide.
    """

    def __init__(self, counts: np.ndarray, dimension: int, inter_user_spread: float,
                 max_group_size: int, seed: int, root_seed: int = 0, phase: str = "report"):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.dimension = int(dimension)
        self.tau = float(inter_user_spread)
        self.max_group_size = int(max_group_size)
        rng = np.random.default_rng(derive_seed(root_seed, "mean_estimation", "population", phase, seed))
        d, n = self.dimension, len(self.counts)
        mu = rng.standard_normal(d)
        self.mu = mu / np.linalg.norm(mu)
        xi = rng.standard_normal((n, d)) / np.sqrt(d)
        self.user_centres = self.mu + self.tau * xi
        # Only the examples a G in the sweep can keep are drawn: columns
        # j >= min(n_u, max G) would never be used.
        self.zeta = rng.standard_normal((n, self.max_group_size, d)) / np.sqrt(d)

    def bounded(self, diversity: float, group_size: int) -> BoundedPool:
        """The pool after keeping min(n_u, G) examples per user, at diversity s."""
        g = int(group_size)
        if g > self.max_group_size:
            raise ValueError(f"group size {g} exceeds the population's max {self.max_group_size}")
        kept = np.minimum(self.counts, g)
        mask = np.arange(g)[None, :] < kept[:, None]  # (N, g)
        zeta = self.zeta[:, :g, :]
        examples = (self.user_centres[:, None, :] + diversity * zeta)[mask]
        zeta_mean = (zeta * mask[:, :, None]).sum(axis=1) / kept[:, None]
        user_means = self.user_centres + diversity * zeta_mean
        return BoundedPool(examples=examples, user_means=user_means, kept=kept)
