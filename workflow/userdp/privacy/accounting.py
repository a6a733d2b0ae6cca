"""Privacy accounting of dp-accounting events, on its privacy-loss-distribution (PLD) code.

`epsilon(event, delta)` is the accountant: it takes the event a mechanism
describes (`mechanism.ELS` / `mechanism.ULS`, `docs/method.md` section 6) and
composes its parts, as dp-accounting's `PLDAccountant` does, with two
changes that only make it faster:

* one step of DP-SGD-ELS is the mixture-of-Gaussians (MoG) mechanism with
  sensitivities 0..G and probabilities Binomial(G, q).pmf. dp-accounting
  builds the MoG PLD with a recursive, scalar binary search
  (`MixtureGaussianPrivacyLoss.inverse_privacy_losses`), 2-5 s per call at
  discretization 1e-4. `_FastMixtureGaussianPrivacyLoss` runs the same
  bisection (same midpoints, same stopping rule, same floor to the precision
  grid) for all privacy losses at once with numpy, so the PLD it builds is
  the one dp-accounting builds, in a fraction of the time; the far binomial
  tail is lumped onto the largest sensitivity (`prune_mixture`, a valid upper
  bound). The Poisson-subsampled Gaussian (ULS) is the MoG {0: 1 - q, 1: q}
  and takes the same path.
* identical step events are composed by one self-composition (k runs of T
  steps of the same step are k * T steps), and fixed releases (the DP
  contribution statistics' `LaplaceDpEvent`) are composed last.

`group_privacy_epsilon` gives the comparison baselines: the example-level
guarantee (PLD, or RDP) converted to G examples by group privacy
(`group_conversion_epsilon`). Tests compare every path with dp-accounting's
own accountant on a grid of (sigma, q, T, G).
"""

from __future__ import annotations

import math
from functools import lru_cache, partial
from typing import Iterable

import numpy as np
from scipy import fft, stats

import dp_accounting
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

from ..errors import AccountingLimitError, PrivacyError
from . import _dp_accounting_compat as compat
from . import memo
from .pld_arrays import connect_dots_pmf, epsilon_for_delta

#: Discretization of the privacy loss at which epsilons are reported.
FINE_DISCRETIZATION = 1e-4

#: Memory bound of one accountant call: the most grid points one privacy-loss
#: distribution (PLD) may hold, for one step and for the T-fold composition
#: (the FFT length of dp-accounting's self-convolution). Sizes are estimated
#: before anything is allocated and a larger PLD is refused with an
#: `AccountingLimitError` (docs/privacy.md, "Memory bound"). 2^23 points keep
#: one call below ~0.7 GB of peak resident memory (measured, see the docs).
MAX_PLD_POINTS = 1 << 23
#: Privacy losses per block when the MoG PLD is built: bounds its
#: [points x mixture components] temporaries (results are unchanged).
PLD_BLOCK = 1 << 16
#: Step PLDs larger than PREFLIGHT_TRIGGER points get a preflight of their composition's size on the same
#: step at most PREFLIGHT_POINTS points coarse (`_preflight_composition`); normal steps are far smaller.
PREFLIGHT_TRIGGER = 1 << 20
PREFLIGHT_POINTS = 1 << 16
#: Tail mass dp-accounting truncates in compositions (its default; used by the size estimate).
TAIL_MASS_TRUNCATION = 1e-15


# ---------------------------------------------------------------- argument checks


def check_arguments(
    noise_multiplier: float | None,
    sampling_rate: float,
    steps: int,
    delta: float,
    group_size: int = 1,
    epsilon: float | None = None,
) -> None:
    """Raise PrivacyError naming the argument when a value is out of range.

    Used by the library entry points and the command line, so a user sees
    "--sampling-rate must be in (0, 1]" rather than a dp-accounting traceback.
    """
    if noise_multiplier is not None and not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise PrivacyError(f"noise multiplier is {noise_multiplier}; it must be a finite number >= 0.")
    if not (0 < sampling_rate <= 1):
        raise PrivacyError(f"sampling rate is {sampling_rate}; it must be in (0, 1].")
    if int(steps) != steps or steps < 0:
        raise PrivacyError(f"steps is {steps}; it must be a whole number >= 0.")
    if not (0 < delta < 1):
        raise PrivacyError(f"delta is {delta}; it must be in (0, 1), e.g. 1e-6.")
    if int(group_size) != group_size or group_size < 1:
        raise PrivacyError(f"group size G is {group_size}; it must be a whole number >= 1.")
    if epsilon is not None and not (epsilon > 0):
        raise PrivacyError(f"epsilon is {epsilon}; it must be > 0 (use inf for the non-private reference).")


# ---------------------------------------------------------------- events


def binomial_sensitivities(group_size: int, sampling_rate: float) -> tuple[list[float], list[float]]:
    """Sensitivities 0..G and their Binomial(G, q) probabilities (the ELS step)."""
    k = np.arange(group_size + 1)
    probs = stats.binom.pmf(k, group_size, sampling_rate)
    return [float(x) for x in k], [float(p) for p in probs]


#: Binomial tail mass below which the MoG components are lumped (see below).
TAIL_MASS = 1e-30


def prune_mixture(sensitivities: Iterable[float], probabilities: Iterable[float]) -> tuple[list[float], list[float]]:
    """MoG components with the far tail moved onto the largest sensitivity.

    Components (in increasing sensitivity) beyond k_max, whose total
    probability is <= TAIL_MASS, are replaced by one component at the
    largest sensitivity carrying their mass. Moving mass to a larger
    sensitivity can only make the mechanism less private (the scalar MoG with
    sensitivities s is a projection, i.e. post-processing, of a vector MoG
    whose sensitivity norms are s' >= s, which Corollary 4.7 of
    Choquette-Choo et al. 2023 bounds by the scalar MoG with s'), so the
    accountant stays a valid upper bound; with TAIL_MASS = 1e-30 the change
    is invisible in double precision, and the PLD is built with a few
    components instead of G + 1 (3x faster at G = 64, q = 0.01).
    """
    s = np.asarray(list(sensitivities), dtype=float)
    order = np.argsort(s, kind="stable")
    p = np.asarray(list(probabilities), dtype=float)[order]
    sens, probs = s[order].tolist(), p.tolist()
    # P(K > k): sums of the probabilities above k, accumulated from the smallest (top) terms.
    sf = np.append(np.cumsum(p[::-1])[::-1][1:], 0.0)
    below = np.nonzero(sf <= TAIL_MASS)[0]
    k_max = int(below[0]) if below.size else len(sens) - 1
    if k_max >= len(sens) - 2:
        return sens, probs
    kept_s, kept_p = sens[: k_max + 1], probs[: k_max + 1]
    rest = 1.0 - math.fsum(kept_p)
    return kept_s + [sens[-1]], kept_p + [max(rest, float(sf[k_max]))]


def pruned_binomial_sensitivities(group_size: int, sampling_rate: float) -> tuple[list[float], list[float]]:
    """Binomial(G, q) sensitivities with the far tail moved onto sensitivity G (`prune_mixture`)."""
    return prune_mixture(*binomial_sensitivities(group_size, sampling_rate))


# ---------------------------------------------------------------- fast MoG PLD


#: One-step delta left at +infinity when the MoG PLD's support is capped.
UPPER_TAIL_DELTA = 1e-15


class _FastMixtureGaussianPrivacyLoss(plm.MixtureGaussianPrivacyLoss):
    """dp-accounting's MoG privacy loss with a vectorised inverse.

    `_inverse_privacy_losses_with_range` in dp-accounting bisects the interval
    [lo, hi] recursively, splitting the set of privacy losses at each midpoint:
    ~25 scalar, Python-level loss evaluations per grid point of the PLD, 2-5 s
    per PLD at discretization 1e-4. Every loss goes through the same sequence
    of interval halvings, stops when the width is <= precision and returns
    floor(hi / precision) * precision. Running that bisection for all losses
    at once with numpy (each with its own lo/hi) gives the same outputs, up to
    the last bits of the log-sum-exp; only the Python overhead goes.
    (A bracketed Newton variant was tried: fewer evaluations, but the flat
    tails of the loss need bisection anyway and it was no faster.)
    """

    def connect_dots_bounds(self) -> plm.ConnectDotsBounds:
        """`_capped_connect_dots_bounds`, computed once per loss (the size estimate and the build both ask)."""
        cached = self.__dict__.get("_userdp_bounds")
        if cached is None:
            cached = self.__dict__["_userdp_bounds"] = self._capped_connect_dots_bounds()
        return cached

    def _capped_connect_dots_bounds(self) -> plm.ConnectDotsBounds:
        """dp-accounting's bounds, with the upper epsilon capped where delta is negligible.

        Connect-the-dots puts the mass delta(eps_max) at +infinity, which is
        valid (pessimistic) for any eps_max. dp-accounting takes eps_max as the
        loss at the 1e-22 tail of the noise, which for small sigma and large G
        is in the hundreds: millions of grid points that carry ~no mass. We
        cap it at the smallest loss whose one-step delta is <= UPPER_TAIL_DELTA
        (1e-15); after T steps that adds at most T * 1e-15 to delta.
        """
        bounds = super().connect_dots_bounds()
        lo, hi = bounds.epsilon_lower, bounds.epsilon_upper
        if hi is None or lo is None or hi - lo < 1.0:
            return bounds
        grid = np.linspace(max(lo, 0.0), hi, 513)
        deltas = np.asarray(self.get_delta_for_epsilon(grid))
        ok = np.nonzero(deltas <= UPPER_TAIL_DELTA)[0]
        if ok.size == 0:
            return bounds
        return plm.ConnectDotsBounds(epsilon_upper=float(grid[ok[0]]), epsilon_lower=lo)

    def get_delta_for_epsilon(self, epsilon):
        """dp-accounting's `get_delta_for_epsilon`, with the per-component CDFs evaluated in blocks.

        The same operations in the same order, row by row, so the same numbers;
        only the [points x components] temporaries are bounded by PLD_BLOCK
        rows, and the final monotone fix-up (a Python loop over all points in
        dp-accounting) is the equivalent reverse running maximum.
        """
        if np.ndim(epsilon) == 0:
            return super().get_delta_for_epsilon(epsilon)
        epsilons = np.atleast_1d(epsilon)
        if not np.all(epsilons[1:] >= epsilons[:-1]):
            raise ValueError(f"Epsilon values must be non-decreasing: {epsilons}")
        deltas = np.zeros_like(epsilons, dtype=float)
        q = self._sampling_prob
        if q == 1.0:
            inverse_indices = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == plm.AdjacencyType.ADD:
            inverse_indices = epsilons < -np.log1p(-q)
        else:
            inverse_indices = epsilons > np.log1p(-q)
            other = np.logical_not(inverse_indices)
            deltas[other] = -np.expm1(epsilons[other])
        eps_in = epsilons[inverse_indices]
        x_cutoffs = self.inverse_privacy_losses(eps_in)
        out = np.empty(eps_in.shape, dtype=float)
        for i in range(0, eps_in.size, PLD_BLOCK):
            x, e = x_cutoffs[i:i + PLD_BLOCK], eps_in[i:i + PLD_BLOCK]
            out[i:i + PLD_BLOCK] = self.mu_upper_cdf(x) - np.exp(e + self.mu_lower_log_cdf(x))
        deltas[inverse_indices] = out
        deltas = np.clip(deltas, 0, 1)
        if np.isnan(deltas).any():  # (an infinite epsilon) dp-accounting's Python max does not carry a NaN down
            for i in reversed(range(deltas.shape[0] - 1)):
                deltas[i] = max(deltas[i], deltas[i + 1])
            return deltas
        return np.maximum.accumulate(deltas[::-1])[::-1].copy()

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
        losses = np.asarray(privacy_losses, dtype=float)
        if losses.size == 0:
            return []
        if losses.size > PLD_BLOCK:  # same bracket for every block: each loss's bisection is unchanged
            return np.concatenate([self._inverse_privacy_losses_with_range(losses[i:i + PLD_BLOCK], bounds, precision)
                                   for i in range(0, losses.size, PLD_BLOCK)])
        lo = np.full(losses.shape, float(bounds[0]))
        hi = np.full(losses.shape, float(bounds[1]))
        # components x losses: the reductions over components run across rows (_logsumexp_columns)
        sens = np.asarray(self.sensitivities, dtype=float)[:, None]
        consts = np.asarray(self._precompute_privacy_loss_constants, dtype=float)[:, None]
        add = self.adjacency_type == plm.AdjacencyType.ADD
        # Each loss keeps halving its own interval until it is <= precision,
        # as the recursion does. All intervals start equal and halve together,
        # so they finish within an iteration of each other; finished ones are
        # frozen with a mask (cheaper than gathering the active ones).
        # The loss at a midpoint depends on the midpoint alone (each column's sums run over its own
        # components), and neighbouring losses share intervals for the first ~log2(n) halvings (sorted
        # losses, as connect-the-dots asks for, keep equal midpoints adjacent): the loss is computed once
        # per run of equal midpoints and spread back, the same numbers with far fewer exp/log.
        active = hi - lo > precision
        while active.any():
            mid = (lo + hi) / 2
            new_run = np.empty(mid.shape, dtype=bool)
            new_run[0] = True
            np.not_equal(mid[1:], mid[:-1], out=new_run[1:])
            distinct = mid[new_run]
            z = np.multiply(sens, distinct[None, :])
            z /= self._variance
            if add:  # consts + z, in place (the same sums)
                z += consts
                pl_distinct = -_logsumexp_columns(z)
            else:
                pl_distinct = _logsumexp_columns(np.subtract(consts, z, out=z))
            pl_mid = pl_distinct[np.cumsum(new_run) - 1] if distinct.size < mid.size else pl_distinct
            go_right = losses < pl_mid
            lo = np.where(active & go_right, mid, lo)
            hi = np.where(active & ~go_right, mid, hi)
            active = hi - lo > precision
        return np.floor(hi / precision) * precision


def _logsumexp_rows(z: np.ndarray) -> np.ndarray:
    """log(sum(exp(z), axis=1)), max-shifted; ~10x faster than logaddexp.reduce.

    It may differ from dp-accounting's scalar logaddexp in the last bits,
    which could move an inverse by one step of its 1e-6 grid: far below
    anything that shows in an epsilon (tests check the agreement).
    """
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1))


#: numpy sums a row of up to this many float64s with 8 interleaved partial sums, longer rows pairwise in blocks.
_UNROLLED_SUM_MAX = 128


def _sum_rows_as_numpy_sums_a_row(a: np.ndarray) -> np.ndarray:
    """`c.sum(axis=1)` of the C-contiguous (n, k) array c = `np.ascontiguousarray(a.T)`, bit for bit, k <= 128.

    numpy adds a contiguous row of k < 8 values left to right, and of 8 <= k <= 128 values in 8 interleaved
    partial sums combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the remainder left to
    right (its pairwise summation below the block size). Doing the same additions across the rows of `a`
    gives the same numbers without reducing along a short axis. This rests on numpy's internal summation order
    (checked on the pinned numpy; tests/test_privacy_accounting.py guards it for every k up to 140).
    """
    k = a.shape[0]
    if k < 8:
        out = a[0].copy()
        for i in range(1, k):
            out += a[i]
        return out
    r = a[:8].copy()  # the 8 partial sums, one row each
    i = 8
    while i < k - k % 8:
        r += a[i:i + 8]
        i += 8
    out = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for i in range(i, k):
        out += a[i]
    return out


def _logsumexp_columns(z: np.ndarray) -> np.ndarray:
    """`_logsumexp_rows(np.ascontiguousarray(z.T))` of a (components, points) array, bit for bit, ~1.7x faster.

    A row-wise max and sum over the few components of each of many points is numpy's slow case (a reduction
    along a short contiguous axis); here the max is an elementwise maximum across rows (exact in any order)
    and the sum repeats numpy's own order (`_sum_rows_as_numpy_sums_a_row`).
    """
    if z.shape[0] > _UNROLLED_SUM_MAX:
        return _logsumexp_rows(np.ascontiguousarray(z.T))
    m = np.maximum.reduce(z, axis=0)
    e = np.subtract(z, m[None, :])
    np.exp(e, out=e)
    return m + np.log(_sum_rows_as_numpy_sums_a_row(e))


def mixture_gaussian_pld(
    noise_multiplier: float,
    sensitivities: Iterable[float],
    probabilities: Iterable[float],
    discretization: float = FINE_DISCRETIZATION,
    what: str | None = None,
) -> pld_lib.PrivacyLossDistribution:
    """One MoG step as a PLD, pessimistic, connect-the-dots (as dp-accounting builds it).

    Its size is estimated from the connect-the-dots bounds first
    (`AccountingLimitError` above MAX_PLD_POINTS, before any grid is built).
    """
    sens = list(sensitivities)
    probs = list(probabilities)
    losses = _mog_losses(noise_multiplier, sens, probs)
    label = what or f"a mixture-of-Gaussians step (sigma = {noise_multiplier:.4g}, sensitivities up to {max(sens):g})"
    for loss in losses:
        check_pld_size(_grid_points(loss, discretization), label, discretization)
    remove, add = (connect_dots_pmf(loss, discretization) for loss in losses)
    return pld_lib.PrivacyLossDistribution(remove, add)


def _mog_losses(noise_multiplier: float, sens: list, probs: list) -> list:
    """The (remove, add) privacy losses of one MoG step."""
    return [_FastMixtureGaussianPrivacyLoss(noise_multiplier, sens, probs, pessimistic_estimate=True,
                                            adjacency_type=adjacency)
            for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD)]


# ---------------------------------------------------------------- memory bound


def _grid_points(loss: plm.AdditiveNoisePrivacyLoss, discretization: float) -> int:
    """Grid points of the connect-the-dots PLD of `loss` (as dp-accounting lays them out), 0 if unknown.

    Unknown bounds (None) are left to dp-accounting, which refuses them itself.
    """
    b = loss.connect_dots_bounds()
    if b.epsilon_upper is None or b.epsilon_lower is None:
        return 0
    span = math.ceil(b.epsilon_upper / discretization) - math.floor(b.epsilon_lower / discretization) + 1
    return int(span) if math.isfinite(span) else MAX_PLD_POINTS + 1


def pld_points(pld: pld_lib.PrivacyLossDistribution) -> int:
    """Grid points of the larger of a PLD's two PMFs."""
    return max(int(pmf.size) for pmf in compat.pld_pmfs(pld))


def check_pld_size(points: int, what: str, discretization: float) -> None:
    """AccountingLimitError when a PLD of `points` grid points would exceed MAX_PLD_POINTS.

    The message names the event, the size, the bound and what to change.
    """
    if points <= MAX_PLD_POINTS:
        return
    raise AccountingLimitError(
        f"the privacy-loss distribution of {what} at discretization {discretization:g} would need "
        f"{points:,} grid points (about {points * BYTES_PER_POINT / 2**30:.1f} GiB), above the accountant's memory "
        f"bound of {MAX_PLD_POINTS:,} points (userdp.privacy.accounting.MAX_PLD_POINTS; docs/privacy.md, "
        "'Memory bound'). It is refused before anything is allocated. Such sizes come from a privacy loss in the "
        "hundreds (a noise multiplier far below the sensitivity, or a near-vacuous delta) or from a very large "
        "step count; they mean an epsilon far from any useful target. Use a larger noise multiplier, fewer steps, "
        "or a coarser discretization (command line: --discretization; pessimistic, still a valid upper bound)."
    )


#: Peak resident bytes per grid point of the largest PLD operation (measured; docs/privacy.md, "Memory bound").
BYTES_PER_POINT = 70


# ---------------------------------------------------------------- composed PLDs


#: dp-accounting's Chernoff orders of `compute_self_convolve_bounds`, in units of 1 / len(pmf) (its default).
_CHERNOFF_ORDERS = np.concatenate((np.arange(-20, 0), np.arange(1, 21)))


def _log_mgf(index: np.ndarray, probs: np.ndarray, nonzero: np.ndarray, order: float,
             out: np.ndarray | None = None) -> float:
    """`scipy.special.logsumexp(index * order, b=probs)` for a nonnegative pmf, bit for bit, ~6x faster.

    scipy's logsumexp (1.17) masks zero weights to -inf, takes the largest term out of the sum, adds the
    others shifted by it and returns log1p(s / m) + log(m) + max; for a = index * order (monotone, order != 0)
    the largest term of the nonzero weights is the last (order > 0) or first (order < 0) of them, so the same
    array is summed by the same `np.sum` here, without its generic index and mask passes. Zero weights need
    no mask: their terms are 0 * exp(d), the same 0 as scipy's 0 * exp(-inf) while exp(d) is finite (the
    Chernoff orders keep |d| below 20); `out` is a work array of the pmf's length (one per bound, not one per
    order and pass). A non-finite result is computed by scipy itself (its fallback differs there);
    tests/test_privacy_accounting.py compares both.
    """
    top = int(nonzero[-1] if order > 0 else nonzero[0])
    d = np.multiply(index, order, out=out)
    a_max = d[top]
    np.subtract(d, a_max, out=d)
    d[top] = -np.inf
    np.exp(d, out=d)
    np.multiply(probs, d, out=d)
    s = np.sum(d)
    m = probs[top]
    if s != 0:
        s = s / m
    result = np.log1p(s) + np.log(m) + a_max
    if not np.isfinite(result):
        from scipy import special

        return float(special.logsumexp(index * order, b=probs))
    return float(result)


def _self_convolve_bounds(probs, steps: int, tail_mass_truncation: float) -> tuple[int, int]:
    """`dp_accounting.pld.common.compute_self_convolve_bounds(probs, steps, tail)`, the same integers, faster.

    dp-accounting (0.6) bounds the T-fold convolution with Chernoff bounds at 40 orders, each a scipy
    logsumexp over the whole pmf: a quarter of a calibration's time. The same bound loop on `_log_mgf`
    (bit-identical log moment generating functions); any other input (not a float64 nonnegative pmf with
    a nonzero entry) goes to dp-accounting's own function.
    """
    probs = np.asarray(probs)
    nonzero = np.flatnonzero(probs)
    if (tail_mass_truncation == 0 or probs.dtype != np.float64 or probs.ndim != 1 or nonzero.size == 0
            or probs.min() < 0):
        return pld_common.compute_self_convolve_bounds(probs, steps, tail_mass_truncation)
    n = len(probs)
    upper, lower = (n - 1) * steps, 0
    index = np.arange(n)
    work = np.empty(n)
    for order in _CHERNOFF_ORDERS / n:
        bound = (steps * _log_mgf(index, probs, nonzero, order, work) + math.log(2 / tail_mass_truncation)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        if order < 0:
            lower = max(lower, math.floor(bound))
    return lower, upper


def _self_convolve_length(probs, steps: int) -> tuple[int, int, int]:
    """dp-accounting's truncation bounds (lo, hi) of a T-fold self-convolution and the FFT length it allocates."""
    lo, hi = _self_convolve_bounds(probs, steps, TAIL_MASS_TRUNCATION)
    return lo, hi, int(fft.next_fast_len(max(hi - lo + 1, len(probs))))


def _preflight_composition(sigma: float, sens: list, probs: list, steps: int, discretization: float,
                           what: str) -> None:
    """Refuse a T-fold MoG composition that cannot fit, before the (slow) fine step PLD is built.

    Building a step PLD of millions of points costs minutes for a mixture with
    many components. When the step has more than PREFLIGHT_TRIGGER points, the
    same step is built at a coarser discretization d_c (at most
    PREFLIGHT_POINTS points, cheap) and its composition length is scaled by
    d_c / d: dp-accounting's Chernoff orders are fixed fractions of the
    support, so the truncation bounds are a fixed span of privacy loss and the
    length scales with 1 / d (the exact check follows after the build).
    """
    losses = _mog_losses(sigma, sens, probs)
    points = max(_grid_points(loss, discretization) for loss in losses)
    check_pld_size(points, what, discretization)
    if points <= PREFLIGHT_TRIGGER or steps <= 1:
        return
    coarse_d = discretization * math.ceil(points / PREFLIGHT_POINTS)
    coarse = mixture_gaussian_pld(sigma, sens, probs, coarse_d, what)
    length = max(_self_convolve_length(compat.dense_parts(pmf).probs, steps)[2] for pmf in compat.pld_pmfs(coarse))
    check_pld_size(int(length * coarse_d / discretization), f"{what}, composed {steps} times (estimated)",
                   discretization)


def _self_compose_pmf(pmf, steps: int, what: str, discretization: float):
    """`DensePLDPmf.self_compose(steps)` of dp-accounting, size-checked between its bounds and its FFT.

    The same operations (`common.self_convolve` and `DensePLDPmf.self_compose`
    of dp-accounting 0.6.0, inlined), so the same numbers; the FFT length
    comes from dp-accounting's own Chernoff truncation bounds and is checked
    against MAX_PLD_POINTS before the FFT allocates it.
    """
    if not isinstance(pmf, pld_pmf.DensePLDPmf):
        return pmf.self_compose(steps, TAIL_MASS_TRUNCATION)  # sparse PMFs are small dictionaries
    parts = compat.dense_parts(pmf)
    probs = parts.probs
    lo, hi, fast_len = _self_convolve_length(probs, steps)
    output_len = hi - lo + 1
    check_pld_size(int(fast_len), f"{what}, composed {steps} times", discretization)
    convolution = np.real(fft.ifft(fft.fft(probs, fast_len) ** steps))
    out = np.roll(convolution, -lo)[:output_len]
    inf_prob = TAIL_MASS_TRUNCATION - math.expm1(steps * math.log1p(-parts.infinity_mass))
    return pld_pmf.DensePLDPmf(parts.discretization, parts.lower_loss * steps + lo, np.array(out), inf_prob,
                               parts.pessimistic_estimate)


def _compose(step_pld: pld_lib.PrivacyLossDistribution, steps: int, discretization: float, what: str):
    # The same operations as PLDAccountant.compose(SelfComposedDpEvent(event, T)).
    steps = int(steps)
    if steps <= 0:
        raise ValueError(f"num_times should be >= 1, num_times={steps}")
    pmfs = [_self_compose_pmf(pmf, steps, what, discretization) for pmf in compat.pld_pmfs(step_pld)]
    identity = pld_lib.identity(value_discretization_interval=discretization)
    return identity.compose(pld_lib.PrivacyLossDistribution(*pmfs))


def _describe_step(step: tuple) -> str:
    kind, sigma = step[0], step[1]
    if kind == "mog":
        return (f"a mixture-of-Gaussians step (sigma = {sigma:.4g}, sensitivities up to {max(step[2]):g}, "
                f"ELS with G = {len(step[2]) - 1})")
    return f"a Poisson-subsampled Gaussian step (sigma = {sigma:.4g}, sampling rate {step[2]:.4g})"


@lru_cache(maxsize=256)
def _composed_step_pld(step: tuple, steps: int, discretization: float):
    """T-fold PLD of one step, keyed by `_step_key`; cached per arguments.

    ("mog", sigma, sensitivities, probabilities): the fast MoG PLD of the
    pruned mixture. ("poisson", sigma, q): the Poisson-subsampled Gaussian,
    which is the MoG {0: 1 - q, 1: q} (the fast path, with the capped support,
    gives the same epsilons as dp-accounting's from_gaussian_mechanism to
    ~1e-9, tested, and is much faster at small sigma); at q = 1 the Gaussian.
    Both the step PLD and its T-fold composition are size-checked before they
    are built (`check_pld_size`).
    """
    kind, sigma = step[0], step[1]
    what = _describe_step(step)
    sensitivity = _certain_sensitivity(step)
    if sensitivity is None:
        sens, probs = prune_mixture(step[2], step[3]) if kind == "mog" else ([0.0, 1.0], [1.0 - step[2], step[2]])
        _preflight_composition(sigma, sens, probs, int(steps), discretization, what)
        pld = mixture_gaussian_pld(sigma, sens, probs, discretization, what)
    else:
        loss = plm.GaussianPrivacyLoss(sigma, sensitivity=sensitivity, pessimistic_estimate=True,
                                       log_mass_truncation_bound=-50, sampling_prob=1.0,
                                       adjacency_type=plm.AdjacencyType.REMOVE)
        check_pld_size(_grid_points(loss, discretization), what, discretization)
        pld = pld_lib.from_gaussian_mechanism(
            standard_deviation=sigma, sensitivity=sensitivity, value_discretization_interval=discretization,
            sampling_prob=1.0, neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        )
    return _compose(pld, steps, discretization, what)


def _certain_sensitivity(step: tuple) -> float | None:
    """The sensitivity of a step that is the plain Gaussian mechanism (no randomness in it), else None.

    ("poisson", sigma, 1): every unit in every step, sensitivity 1. ("mog", sigma, sens, probs) with all its
    probability on one sensitivity s (ELS at q = 1: Binomial(G, 1) puts it on G): the Gaussian mechanism with
    sensitivity s, which is what the mixture is. dp-accounting's MoG tail search fails on such a mixture
    (its lower truncation lies exactly at the end of its search interval and, by rounding, the search can
    return None: TypeError), so it is composed as the Gaussian it is.
    """
    if step[0] != "mog":
        return 1.0 if step[2] >= 1 else None
    positive = [float(s) for s, p in zip(step[2], step[3]) if p > 0]
    return positive[0] if len(positive) == 1 and positive[0] > 0 else None


def _step_key(event: dp_accounting.DpEvent) -> tuple | None:
    """Hashable description of one noisy step; None when the step adds no noise (no guarantee)."""
    if isinstance(event, dp_accounting.dp_event.MixtureOfGaussiansDpEvent):
        sigma = float(event.standard_deviation)
        return ("mog", sigma, tuple(map(float, event.sensitivities)), tuple(map(float, event.sampling_probs))) \
            if sigma > 0 else None
    q = 1.0
    inner = event
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        q, inner = float(event.sampling_probability), event.event
    if isinstance(inner, dp_accounting.GaussianDpEvent):
        sigma = float(inner.noise_multiplier)
        return ("poisson", sigma, q) if sigma > 0 else None
    raise PrivacyError(
        f"DP event {event!r} is not supported; the accountant composes mixture-of-Gaussians, (Poisson-subsampled) "
        "Gaussian and Laplace events."
    )


def _flatten(event: dp_accounting.DpEvent, count: int, steps: dict[tuple, int], fixed: list) -> bool:
    """Collect noisy steps (key -> how many times) and fixed Laplace releases of `count` times `event`; False if
    any part of it happens and is non-private. Every part is checked, also at count 0 (PrivacyError for an event
    the accountant does not support)."""
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return True
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return count == 0
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return all([_flatten(e, count, steps, fixed) for e in event.events])
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _flatten(event.event, count * int(event.count), steps, fixed)
    if isinstance(event, dp_accounting.LaplaceDpEvent):
        fixed.extend([event] * count)
        return True
    key = _step_key(event)
    if key is None:
        return count == 0
    if count:
        steps[key] = steps.get(key, 0) + count
    return True


def epsilon(event: dp_accounting.DpEvent, delta: float, discretization: float = FINE_DISCRETIZATION) -> float:
    """User-level epsilon at `delta` of `event` (pessimistic PLD at `discretization`, 1e-4 by default).

    A non-private part (`NonPrivateDpEvent`, or a step without noise) gives
    inf; no steps give the fixed releases' epsilon (0 without any).
    """
    steps: dict[tuple, int] = {}
    fixed: list = []
    private = _flatten(event, 1, steps, fixed)
    return _parts_epsilon(steps, tuple(fixed), private, delta, discretization)


def _parts_epsilon(steps: dict[tuple, int], extra: tuple, private: bool, delta: float, discretization: float
                   ) -> float:
    """epsilon(delta) of flattened parts (`_flatten`): inf when a part is non-private."""
    if not (0 < delta < 1):
        raise PrivacyError(f"delta is {delta}; it must be in (0, 1), e.g. 1e-6.")
    if not private:
        return math.inf
    if not steps:
        return fixed_events_epsilon(extra, delta, discretization)
    # The same flattened computation recurs across plan, ledgers and selection: memo.py (on in the pipeline).
    k = memo.key("pld", sorted(steps.items()), extra, float(delta), float(discretization))
    hit = memo.lookup(k)
    if hit is not None:
        return hit
    value = _steps_epsilon(steps, extra, delta, discretization)
    memo.store(k, value)
    return value


def _steps_pld(steps: dict, discretization: float):
    """PLD of the noisy steps composed (each distinct step's T-fold composition, in the memo's key order), or None."""
    pld = None
    for key, n in sorted(steps.items()):
        part = _composed_step_pld(key, int(n), float(discretization))
        if pld is not None:
            check_pld_size(pld_points(pld) + pld_points(part), "the composition of different step events",
                           discretization)
        pld = part if pld is None else pld.compose(part)
    return pld


def _steps_epsilon(steps: dict, extra: tuple, delta: float, discretization: float) -> float:
    """epsilon(delta) of the noisy steps composed with the fixed events when there are any."""
    if extra:
        _fixed_pld(extra, float(discretization))  # cached; refuses an oversized release before the steps are built
    pld = _with_fixed(_steps_pld(steps, discretization), extra, float(discretization))
    return float(epsilon_for_delta(pld, delta))


class UserLevelAccountant(dp_accounting.PrivacyAccountant):
    """This module's accountant behind dp-accounting's `PrivacyAccountant` interface: `compose` events (as
    `PLDAccountant` takes them), then `get_epsilon(delta)` (the number `epsilon` gives for the composed event,
    bit for bit, memo included) or `get_delta(epsilon)`.

    Supports what `epsilon` does: mixture-of-Gaussians (ELS) and (Poisson-subsampled) Gaussian (ULS) steps,
    Laplace releases (the DP contribution statistics), their compositions and self-compositions, no-op and
    non-private events (epsilon inf); add/remove-one-user adjacency, pessimistic PLD at `discretization`.
    """

    def __init__(self, discretization: float = FINE_DISCRETIZATION):
        super().__init__(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        self.discretization = float(discretization)
        self._steps: dict[tuple, int] = {}
        self._fixed: list = []
        self._private = True

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int, do_compose: bool
                       ) -> dp_accounting.PrivacyAccountant.CompositionErrorDetails | None:
        steps: dict[tuple, int] = {}
        fixed: list = []
        try:
            private = _flatten(event, count, steps, fixed)
        except PrivacyError as exc:
            return self.CompositionErrorDetails(invalid_event=event, error_message=str(exc))
        if do_compose:
            for key, n in steps.items():
                self._steps[key] = self._steps.get(key, 0) + n
            self._fixed.extend(fixed)
            self._private = self._private and private
        return None

    def get_epsilon(self, target_delta: float) -> float:
        return _parts_epsilon(dict(self._steps), tuple(self._fixed), self._private, target_delta,
                              self.discretization)

    def get_delta(self, target_epsilon: float) -> float:
        """The smallest delta at which the composed events are (target_epsilon, delta)-DP (1 if non-private)."""
        if not self._private:
            return 1.0
        pld = _with_fixed(_steps_pld(self._steps, self.discretization), tuple(self._fixed), self.discretization)
        return 0.0 if pld is None else float(pld.get_delta_for_epsilon(float(target_epsilon)))


# ---------------------------------------------------------------- fixed extra events


@lru_cache(maxsize=64)
def _fixed_pld(extra_events: tuple, discretization: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of fixed (not calibrated) events composed once, e.g. the DP contribution statistics.

    Laplace releases are built as dp-accounting's PLDAccountant builds a
    `LaplaceDpEvent` (`from_laplace_mechanism(parameter=noise_multiplier)`,
    pessimistic, connect-the-dots, add/remove adjacency).
    """
    for e in extra_events:
        if not isinstance(e, dp_accounting.LaplaceDpEvent):
            raise PrivacyError(
                f"extra DP event {e!r} is not supported; the accountants compose LaplaceDpEvent releases "
                "(the DP contribution statistics) with the training steps."
            )
        if not (e.noise_multiplier > 0 and math.isfinite(e.noise_multiplier)):
            raise PrivacyError(f"extra DP event {e!r}: the Laplace noise multiplier must be a finite number > 0.")
    # A Laplace PLD spans privacy losses [-1/b, 1/b] (b = noise multiplier): 2 / (b d) points each.
    points = sum(_grid_points(plm.LaplacePrivacyLoss(float(e.noise_multiplier)), discretization) for e in extra_events)
    check_pld_size(points, f"the fixed Laplace release(s) {[float(e.noise_multiplier) for e in extra_events]} "
                   "(noise multipliers; epsilon = 1 / noise multiplier)", discretization)
    pld = pld_lib.identity(value_discretization_interval=discretization)
    for e in extra_events:
        pld = pld.compose(pld_lib.from_laplace_mechanism(
            parameter=float(e.noise_multiplier), value_discretization_interval=discretization))
    return pld


def fixed_events_epsilon(extra_events, delta: float, discretization: float = FINE_DISCRETIZATION) -> float:
    """Epsilon at delta of the fixed events alone (0 when there are none)."""
    extra = tuple(extra_events)
    if not extra:
        return 0.0
    return float(epsilon_for_delta(_fixed_pld(extra, float(discretization)), delta))


def _with_fixed(pld, extra_events: tuple, discretization: float):
    """The training PLD (None: no steps) composed with the fixed events when there are any, size-checked."""
    if not extra_events:
        return pld
    fixed = _fixed_pld(extra_events, discretization)
    if pld is None:
        return fixed
    check_pld_size(pld_points(pld) + pld_points(fixed), "the training steps composed with the fixed releases",
                   discretization)
    return pld.compose(fixed)


def log_group_delta_factor(group_size: int, eps_ex: float) -> float:
    """log of sum_{k<G} e^{k eps_ex} = log((e^{G eps_ex} - 1) / (e^{eps_ex} - 1)), the group-privacy delta factor.

    Group privacy (Vadhan 2017, "The complexity of differential privacy",
    Lemma 2.2, in the form of the penultimate line of its proof): an
    (eps_ex, delta_ex) guarantee for one example gives, for G examples,
    (G eps_ex, delta_ex * sum_{k<G} e^{k eps_ex}). The factor is at most
    G e^{(G-1) eps_ex}, the lemma's statement.
    """
    G = int(group_size)
    if G == 1:
        return 0.0
    if eps_ex <= 0:
        return math.log(G)
    # log((e^{G e} - 1) / (e^e - 1)) without overflow: G e + log1p(-e^{-G e}) - e - log1p(-e^{-e}).
    return (G - 1) * eps_ex + math.log(-math.expm1(-G * eps_ex)) - math.log(-math.expm1(-eps_ex))


def group_conversion_epsilon(delta_of_epsilon, group_size: int, delta: float, eps_lower: float) -> float:
    """The smallest G * eps_ex with delta_ex(eps_ex) * factor(G, eps_ex) <= delta (inf if none up to 1e4 / G).

    delta_of_epsilon: the example-level privacy curve eps_ex -> delta_ex.
    eps_lower: an example-level epsilon known to be infeasible or the
    smallest candidate (the curve's epsilon at delta / G: the factor is at
    least G). Doubling from it finds a feasible end, bisection to a relative
    width of 1e-6 narrows it, and the feasible end is returned (a valid bound).
    """
    G = int(group_size)
    log_delta = math.log(delta)

    def ok(eps_ex: float) -> bool:
        d_ex = float(delta_of_epsilon(eps_ex))
        return d_ex <= 0 or math.log(d_ex) + log_group_delta_factor(G, eps_ex) <= log_delta

    lo = float(eps_lower)
    if ok(lo):
        return G * lo
    hi = max(2 * lo, 1e-3)
    while not ok(hi):
        lo, hi = hi, 2 * hi
        if hi > 1e4 / G:
            return math.inf
    while hi - lo > 1e-6 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return G * hi


def group_privacy_epsilon(
    noise_multiplier, sampling_rate, steps, delta, group_size, discretization=FINE_DISCRETIZATION, rdp=False
) -> float:
    """User-level epsilon of ELS by group privacy from the example-level PLD (rdp: RDP) guarantee.

    The example-level curve is the PLD of the Poisson-subsampled Gaussian
    (tight); the conversion is `group_conversion_epsilon`. The PLD's
    pessimistic tail truncation puts a small mass at infinite privacy loss,
    so delta_ex(eps_ex) has a floor: the factor e^{(G-1) eps_ex} outgrows it,
    and at large targets (epsilon 16 at G = 4 in the default comparison)
    the bound jumps from ~12 to infinity as sigma falls.

    rdp: the baseline of the study's authors' code, which has no such floor:
    tensorflow_privacy's `compute_dp_sgd_privacy_lib` (user-level path, RDP
    accountant, Poisson sampling, no microbatching): dp-accounting's
    `RdpAccountant` (default orders) on T Poisson-subsampled Gaussian steps
    gives delta_ex(eps_ex), converted to G examples by the same lemma.
    """
    check_arguments(noise_multiplier, sampling_rate, steps, delta, group_size)
    if noise_multiplier == 0 and steps != 0:
        return math.inf
    if steps == 0:
        return 0.0
    if rdp:
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        acc = rdp_lib.RdpAccountant()
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            float(sampling_rate), dp_accounting.GaussianDpEvent(float(noise_multiplier))), int(steps)))
        epsilon_of, delta_of = acc.get_epsilon, acc.get_delta
    else:
        pld = _composed_step_pld(("poisson", float(noise_multiplier), float(sampling_rate)), int(steps),
                                 float(discretization))
        epsilon_of, delta_of = partial(epsilon_for_delta, pld), pld.get_delta_for_epsilon
    G = int(group_size)
    if G == 1:
        return float(epsilon_of(delta))
    return group_conversion_epsilon(delta_of, G, delta, epsilon_of(delta / G))


def library_versions() -> dict[str, str]:
    """Versions of the accounting libraries (for plans and ledgers)."""
    import importlib.metadata as md

    return {"dp-accounting": md.version("dp-accounting"), "numpy": np.__version__}
