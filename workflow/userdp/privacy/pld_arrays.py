"""Two of dp-accounting's PLD operations on numpy arrays: the same numbers without its per-point Python loops.

dp-accounting 0.6.0 (pinned) does these two steps of every accountant call point by point in Python:

* `connect_dots_pmf`: the pessimistic connect-the-dots PMF of one step
  (`privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(...,
  use_connect_dots=True)` with `pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap`)
  computes the probabilities as an array, puts them in a {loss index: probability}
  dictionary and `create_pmf` turns the dictionary back into a list
  (`common.dictionary_to_list`). Here the array goes into the dense PMF directly.
* `epsilon_for_delta`: `PrivacyLossDistribution.get_epsilon_for_delta` walks
  the losses from the largest down (`pld_pmf._get_epsilon_for_delta`), adding
  each probability and each probability times exp(-loss) to two running sums
  until the hockey-stick condition holds. Here the running sums are
  `np.add.accumulate` (a sequential sum: the same additions in the same order),
  the terms use `math.exp` itself (numpy's exp may differ in the last bit on
  some CPUs) and the stopping condition is located with numpy, then confirmed
  with `math.log` at the candidate points.

Both give dp-accounting's results bit for bit (tests/test_pld_arrays.py compares
them on many PMFs); anything outside the dense, float64 case is handed to
dp-accounting itself. In the pipeline they were a sixth of each calibration's time.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

from . import _dp_accounting_compat as compat

#: exp(x) is finite for x up to ~709.78; terms with -loss above this are not computed here.
_EXP_SAFE = 709.0


def connect_dots_pmf(loss: plm.MonotonePrivacyLoss, discretization: float) -> pld_pmf.PLDPmf:
    """dp-accounting's pessimistic connect-the-dots PMF of `loss` at `discretization`, the same object.

    A continuous loss whose grid has more than dp-accounting's sparse limit
    (1000 points) is built here; any other (discrete losses, missing bounds,
    small grids) by dp-accounting.
    """
    bounds = loss.connect_dots_bounds()
    if loss.is_discrete or bounds.epsilon_upper is None or bounds.epsilon_lower is None:
        return compat.library_connect_dots_pmf(loss, discretization)
    upper = math.ceil(bounds.epsilon_upper / discretization)
    lower = math.floor(bounds.epsilon_lower / discretization)
    if upper - lower + 1 <= compat.MAX_PMF_SPARSE_SIZE:
        return compat.library_connect_dots_pmf(loss, discretization)
    deltas = loss.get_delta_for_epsilon(np.arange(lower, upper + 1) * discretization)
    return _dense_connect_dots(discretization, lower, upper, deltas)


def _dense_connect_dots(discretization: float, lower: int, upper: int, deltas) -> pld_pmf.DensePLDPmf:
    """`create_pmf_pessimistic_connect_dots_fixed_gap` above the sparse limit (its dense case).

    The same checks and the same array operations in the same order (Algorithm 1 of Doroshenko et al.,
    "Connect the Dots", arXiv 2207.04380); the probabilities go into the dense PMF without the dictionary.
    """
    deltas = np.asarray(deltas, dtype=np.float64)
    if deltas.size != upper - lower + 1:
        raise ValueError(f"{deltas.size} deltas for {upper - lower + 1} epsilons")
    if np.any(deltas < 0) or np.any(deltas > 1):
        raise ValueError(f"deltas are not between 0 and 1 : deltas={deltas}.")
    if np.any(np.diff(deltas) > compat.DELTA_DIFF_TOLERANCE):
        raise ValueError(f"deltas are not in non-increasing order: deltas={deltas}.")
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + diffs[0] / math.expm1(discretization)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(discretization)) / math.expm1(discretization)
    probs[-1] = diffs[-1] / math.expm1(-discretization)
    probs = np.maximum(0.0, probs)
    return pld_pmf.DensePLDPmf(discretization, lower, probs, deltas[-1], True)


def epsilon_for_delta(pld: pld_lib.PrivacyLossDistribution, delta: float) -> float:
    """`pld.get_epsilon_for_delta(delta)`, the same number (the larger of the remove and add epsilons)."""
    return max(_pmf_epsilon(pmf, delta) for pmf in compat.pld_pmfs(pld))


def _pmf_epsilon(pmf: pld_pmf.PLDPmf, delta: float) -> float:
    """`pmf.get_epsilon_for_delta(delta)` of a dense float64 PMF without the Python loop; others as they are."""
    probs = compat.dense_probs(pmf)
    if not isinstance(probs, np.ndarray) or probs.ndim != 1 or probs.dtype != np.float64 or probs.size < 2:
        return pmf.get_epsilon_for_delta(delta)
    parts = compat.dense_parts(pmf)
    infinity_mass = parts.infinity_mass
    if infinity_mass > delta:
        return math.inf
    d = parts.discretization
    n = probs.size
    p = probs[::-1]  # the losses from the largest down, as dp-accounting walks them
    # dp-accounting's losses come from itertools.count(upper, -d): each is the previous plus -d
    steps = np.full(n, -d)
    steps[0] = (parts.lower_loss + n - 1) * d
    losses = np.add.accumulate(steps)
    # the two running sums before step i (index i) and after the last (index n)
    upper = np.empty(n + 1)
    upper[0] = infinity_mass
    upper[1:] = p
    np.add.accumulate(upper, out=upper)
    # exp(-loss) overflows below a loss of about -709.78 (math.exp raises there, as dp-accounting's loop does
    # if it gets that far): the terms from `safe` on are not computed, and a walk that needs them is left to
    # dp-accounting
    safe = int(np.searchsorted(-losses, _EXP_SAFE, side="right"))
    lower = np.full(n + 1, np.nan)
    lower[0] = 0.0
    lower[1:safe + 1] = np.fromiter(map(math.exp, (-losses[:safe]).tolist()), dtype=np.float64, count=safe)
    lower[1:safe + 1] *= p[:safe]
    np.add.accumulate(lower[:safe + 1], out=lower[:safe + 1])
    # step i (i <= safe, i < n) stops before adding its loss where mass_upper > delta, mass_lower > 0 and
    # log((mass_upper - delta) / mass_lower) >= loss_i; numpy's log finds the candidates (it is within a few
    # units in the last place of math.log, far inside the margin), math.log decides, in order.
    m = min(safe + 1, n)
    u, lo, loss = upper[:m], lower[:m], losses[:m]
    live = (u > delta) & (lo > 0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = (u - delta) / lo
        # a ratio that underflows to 0 is a candidate too: dp-accounting's math.log raises there
        near = (np.log(ratio) >= loss - 1e-9 * (1.0 + np.abs(loss))) | (ratio == 0)
    stop = None
    for i in np.flatnonzero(live & near):
        # numpy scalars, as dp-accounting's sums are: the same promotion (a float32 delta stays float64)
        if math.log((u[i] - delta) / lo[i]) >= loss[i]:
            stop = int(i)
            break
    # after adding loss i: mass_upper >= delta with mass_lower == 0 (exp(-loss) underflowed) returns max(0, loss)
    zero = np.flatnonzero((upper[1:safe + 1] >= delta) & (lower[1:safe + 1] == 0))
    if zero.size and (stop is None or zero[0] < stop):
        return max(0, float(losses[zero[0]]))
    if stop is None:
        if safe < n:
            return pmf.get_epsilon_for_delta(delta)
        stop = n
    mass_upper, mass_lower = upper[stop], lower[stop]
    if mass_upper <= mass_lower + delta:
        return 0
    with np.errstate(divide="ignore", invalid="ignore"):  # a NaN delta gives NaN, as in dp-accounting
        return math.log((mass_upper - delta) / mass_lower)
