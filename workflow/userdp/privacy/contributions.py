"""The train users' contribution counts n_u, as the rules for choosing G read them.

Two sources behind one interface (`Contributions`):

* `ExactCounts`: the counts themselves (treated as public by default, as in
  the study; docs/privacy.md says so);
* `contribution_stats.NoisyHistogram`: a DP histogram of the counts over
  power-of-two bins (`privacy.contribution_stats.private`), whose Laplace
  release is composed into every cell's epsilon (`dp_events`).

Both are weighted histograms over bins with lower edges (ExactCounts: one
bin per distinct count), and every statistic is computed from that one
representation with one definition:

* the p-quantile is the lower edge of the first bin whose cumulative weight
  reaches p * total (for exact counts: the smallest count c with at least a
  share p of users at or below c; the median is the LOWER median, a count
  some user has, so no rounding is needed);
* mbar_G (the mean of min(n_u, G)) and mean_u rho(min(n_u, G)) weight each
  bin's lower edge (exact for exact counts; for the histogram an
  underestimate of at most a factor 2 below G, see contribution_stats).

The ELS median rule and the ULS SNR rule (`group_size`) and the
mean-estimation study read only this interface.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import dp_accounting

from ..errors import PrivacyError


def clipping_survival(m: np.ndarray | float, noise_ratio: float) -> np.ndarray:
    """rho(m) = 1 / sqrt(1 + r / m): the signal kept by clipping an average of m gradients."""
    return 1.0 / np.sqrt(1.0 + noise_ratio / np.asarray(m, dtype=float))


def powers_of_two_up_to(cap: int) -> list[int]:
    """1, 2, 4, ... <= max(1, cap): the candidate G values of the SNR rule."""
    return [1 << k for k in range(max(1, int(cap)).bit_length())]


class Contributions:
    """Counts n_u as a weighted histogram: `lower_edges` [K] int64 and `weights` [K] float >= 0."""

    lower_edges: np.ndarray
    weights: np.ndarray

    #: Fixed DP releases the statistics cost (composed into every cell's epsilon); none for exact counts.
    dp_events: tuple[dp_accounting.DpEvent, ...] = ()

    @property
    def total(self) -> float:
        return float(self.weights.sum())

    def quantile(self, p: float) -> int:
        """Lower edge of the first bin whose cumulative weight reaches p * total (1 if empty)."""
        if self.total <= 0:
            return 1
        cum = np.cumsum(self.weights)
        k = int(np.searchsorted(cum, p * self.total - 1e-9 * self.total, side="left"))
        return int(self.lower_edges[min(k, self.lower_edges.size - 1)])

    def median_group_size(self) -> int:
        """The ELS heuristic: G = the median contribution (at least 1)."""
        return max(1, self.quantile(0.5))

    def group_size_candidates(self, max_quantile: float) -> list[int]:
        """Powers of two from 1 up to the `max_quantile` quantile."""
        return powers_of_two_up_to(self.quantile(max_quantile))

    def _mean(self, values: np.ndarray) -> float:
        if self.total <= 0:
            return float(values[0])  # empty release: every user at the first bin's edge (n = 1)
        return float((self.weights * values).sum() / self.total)

    def _bounded_edges(self, group_size: int) -> np.ndarray:
        return np.minimum(self.lower_edges, int(group_size)).astype(float)

    def mean_bounded(self, group_size: int) -> float:
        """mbar_G = mean_u min(n_u, G)."""
        return self._mean(self._bounded_edges(group_size))

    def mean_survival(self, group_size: int, noise_ratio: float) -> float:
        """mean_u rho(min(n_u, G)) (`clipping_survival`)."""
        return self._mean(clipping_survival(self._bounded_edges(group_size), noise_ratio))


class ExactCounts(Contributions):
    """The exact counts of the train users (one bin per distinct count)."""

    def __init__(self, counts: Sequence[int] | np.ndarray):
        c = np.asarray(counts, dtype=np.int64)
        if c.size == 0:
            raise PrivacyError("no train users: cannot bound contributions or plan a run.")
        self.counts = c
        edges, weights = np.unique(c, return_counts=True)
        self.lower_edges = edges.astype(np.int64)
        self.weights = weights.astype(float)

    @property
    def n_users(self) -> int:
        return int(self.counts.size)

    def n_bounded(self, group_size: int) -> int:
        """N_G = sum_u min(n_u, G) (exact)."""
        return int(np.minimum(self.counts, int(group_size)).sum())

    def mean_bounded(self, group_size: int) -> float:
        """mbar_G = N_G / N, computed on the counts (bit-for-bit the mean the pool has)."""
        return float(np.minimum(self.counts, int(group_size)).mean())

    def mean_survival(self, group_size: int, noise_ratio: float) -> float:
        return float(clipping_survival(np.minimum(self.counts, int(group_size)), noise_ratio).mean())
