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

`group_privacy_epsilon` is the comparison baseline: the example-level
guarantee converted to G examples by group privacy. Tests compare every path
with dp-accounting's own accountant on a grid of (sigma, q, T, G).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable

import numpy as np
from scipy import stats

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

from ..errors import PrivacyError

#: Discretization of the privacy loss at which epsilons are reported.
FINE_DISCRETIZATION = 1e-4


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


def prune_mixture(
    sensitivities: Iterable[float], probabilities: Iterable[float], tail_mass: float = TAIL_MASS
) -> tuple[list[float], list[float]]:
    """MoG components with the far tail moved onto the largest sensitivity.

    Components (in increasing sensitivity) beyond k_max, whose total
    probability is <= `tail_mass`, are replaced by one component at the
    largest sensitivity carrying their mass. Moving mass to a larger
    sensitivity can only make the mechanism less private (the scalar MoG with
    sensitivities s is a projection, i.e. post-processing, of a vector MoG
    whose sensitivity norms are s' >= s, which Corollary 4.7 of
    Choquette-Choo et al. 2023 bounds by the scalar MoG with s'), so the
    accountant stays a valid upper bound; with tail_mass = 1e-30 the change
    is invisible in double precision, and the PLD is built with a few
    components instead of G + 1 (3x faster at G = 64, q = 0.01).
    """
    order = np.argsort(np.asarray(list(sensitivities), dtype=float), kind="stable")
    sens = [float(x) for x in np.asarray(list(sensitivities), dtype=float)[order]]
    probs = [float(x) for x in np.asarray(list(probabilities), dtype=float)[order]]
    p = np.asarray(probs)
    # P(K > k): sums of the probabilities above k, accumulated from the smallest (top) terms.
    sf = np.append(np.cumsum(p[::-1])[::-1][1:], 0.0)
    below = np.nonzero(sf <= tail_mass)[0]
    k_max = int(below[0]) if below.size else len(sens) - 1
    if k_max >= len(sens) - 2:
        return sens, probs
    kept_s, kept_p = sens[: k_max + 1], probs[: k_max + 1]
    rest = 1.0 - math.fsum(kept_p)
    return kept_s + [sens[-1]], kept_p + [max(rest, float(sf[k_max]))]


def pruned_binomial_sensitivities(
    group_size: int, sampling_rate: float, tail_mass: float = TAIL_MASS
) -> tuple[list[float], list[float]]:
    """Binomial(G, q) sensitivities with the far tail moved onto sensitivity G (`prune_mixture`)."""
    return prune_mixture(*binomial_sensitivities(group_size, sampling_rate), tail_mass=tail_mass)


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

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):  # noqa: D401
        losses = np.asarray(privacy_losses, dtype=float)
        if losses.size == 0:
            return []
        lo = np.full(losses.shape, float(bounds[0]))
        hi = np.full(losses.shape, float(bounds[1]))
        sens = self.sensitivities[None, :]
        consts = self._precompute_privacy_loss_constants[None, :]
        add = self.adjacency_type == plm.AdjacencyType.ADD
        # Each loss keeps halving its own interval until it is <= precision,
        # as the recursion does. All intervals start equal and halve together,
        # so they finish within an iteration of each other; finished ones are
        # frozen with a mask (cheaper than gathering the active ones).
        active = hi - lo > precision
        while active.any():
            mid = (lo + hi) / 2
            z = sens * mid[:, None] / self._variance
            pl_mid = -_logsumexp_rows(consts + z) if add else _logsumexp_rows(consts - z)
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


def mixture_gaussian_pld(
    noise_multiplier: float,
    sensitivities: Iterable[float],
    probabilities: Iterable[float],
    discretization: float = FINE_DISCRETIZATION,
) -> pld_lib.PrivacyLossDistribution:
    """One MoG step as a PLD, pessimistic, connect-the-dots (as dp-accounting builds it)."""
    sens = list(sensitivities)
    probs = list(probabilities)

    def one(adjacency: plm.AdjacencyType):
        loss = _FastMixtureGaussianPrivacyLoss(
            noise_multiplier, sens, probs, pessimistic_estimate=True, adjacency_type=adjacency
        )
        return pld_lib._create_pld_pmf_from_monotone_privacy_loss(  # noqa: SLF001 (pinned dp-accounting 0.6.0)
            loss, pessimistic_estimate=True, value_discretization_interval=discretization, use_connect_dots=True
        )

    return pld_lib.PrivacyLossDistribution(one(plm.AdjacencyType.REMOVE), one(plm.AdjacencyType.ADD))


# ---------------------------------------------------------------- composed PLDs


def _compose(step_pld: pld_lib.PrivacyLossDistribution, steps: int, discretization: float):
    # The same operations as PLDAccountant.compose(SelfComposedDpEvent(event, T)).
    identity = pld_lib.identity(value_discretization_interval=discretization)
    return identity.compose(step_pld.self_compose(int(steps)))


@lru_cache(maxsize=256)
def _composed_step_pld(step: tuple, steps: int, discretization: float):
    """T-fold PLD of one step, keyed by `_step_key`; cached per arguments.

    ("mog", sigma, sensitivities, probabilities): the fast MoG PLD of the
    pruned mixture. ("poisson", sigma, q): the Poisson-subsampled Gaussian,
    which is the MoG {0: 1 - q, 1: q} (the fast path, with the capped support,
    gives the same epsilons as dp-accounting's from_gaussian_mechanism to
    ~1e-9, tested, and is much faster at small sigma); at q = 1 the Gaussian.
    """
    kind, sigma = step[0], step[1]
    if kind == "mog":
        sens, probs = prune_mixture(step[2], step[3])
        pld = mixture_gaussian_pld(sigma, sens, probs, discretization)
    elif step[2] < 1:
        q = step[2]
        pld = mixture_gaussian_pld(sigma, [0.0, 1.0], [1.0 - q, q], discretization)
    else:
        pld = pld_lib.from_gaussian_mechanism(
            standard_deviation=sigma, value_discretization_interval=discretization, sampling_prob=1.0,
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        )
    return _compose(pld, steps, discretization)


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
    """Collect noisy steps (key -> how many times) and fixed Laplace releases; False if anything is non-private."""
    if isinstance(event, dp_accounting.NoOpDpEvent) or count == 0:
        return True
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return False
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return all([_flatten(e, count, steps, fixed) for e in event.events])
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _flatten(event.event, count * int(event.count), steps, fixed)
    if isinstance(event, dp_accounting.LaplaceDpEvent):
        fixed.extend([event] * count)
        return True
    key = _step_key(event)
    if key is None:
        return False
    steps[key] = steps.get(key, 0) + count
    return True


def epsilon(event: dp_accounting.DpEvent, delta: float, discretization: float = FINE_DISCRETIZATION) -> float:
    """User-level epsilon at `delta` of `event` (pessimistic PLD at `discretization`, 1e-4 by default).

    A non-private part (`NonPrivateDpEvent`, or a step without noise) gives
    inf; no steps give the fixed releases' epsilon (0 without any).
    """
    if not (0 < delta < 1):
        raise PrivacyError(f"delta is {delta}; it must be in (0, 1), e.g. 1e-6.")
    steps: dict[tuple, int] = {}
    fixed: list = []
    if not _flatten(event, 1, steps, fixed):
        return math.inf
    extra = tuple(fixed)
    if not steps:
        return fixed_events_epsilon(extra, delta, discretization)
    pld = None
    for key, n in steps.items():
        part = _composed_step_pld(key, int(n), float(discretization))
        pld = part if pld is None else pld.compose(part)
    return _epsilon_of(pld, extra, delta, float(discretization))


# ---------------------------------------------------------------- fixed extra events


def _check_fixed_events(extra_events: tuple) -> None:
    for e in extra_events:
        if not isinstance(e, dp_accounting.LaplaceDpEvent):
            raise PrivacyError(
                f"extra DP event {e!r} is not supported; the accountants compose LaplaceDpEvent releases "
                "(the DP contribution statistics) with the training steps."
            )
        if not (e.noise_multiplier > 0 and math.isfinite(e.noise_multiplier)):
            raise PrivacyError(f"extra DP event {e!r}: the Laplace noise multiplier must be a finite number > 0.")


@lru_cache(maxsize=64)
def _fixed_pld(extra_events: tuple, discretization: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of fixed (not calibrated) events composed once, e.g. the DP contribution statistics.

    Laplace releases are built as dp-accounting's PLDAccountant builds a
    `LaplaceDpEvent` (`from_laplace_mechanism(parameter=noise_multiplier)`,
    pessimistic, connect-the-dots, add/remove adjacency).
    """
    _check_fixed_events(extra_events)
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
    return float(_fixed_pld(extra, float(discretization)).get_epsilon_for_delta(delta))


def _epsilon_of(pld, extra_events: tuple, delta: float, discretization: float) -> float:
    """epsilon(delta) of the training PLD, composed with the fixed events when there are any."""
    if extra_events:
        pld = pld.compose(_fixed_pld(extra_events, discretization))
    return float(pld.get_epsilon_for_delta(delta))


def group_privacy_epsilon(
    noise_multiplier, sampling_rate, steps, delta, group_size, discretization=FINE_DISCRETIZATION
) -> float:
    """User-level epsilon of ELS by group privacy from the example-level guarantee.

    An (eps_ex, delta_ex) example-level guarantee gives, for a group of G
    examples, (G eps_ex, G e^{(G-1) eps_ex} delta_ex). We return the smallest
    G * eps_ex over the example-level privacy curve with
    G e^{(G-1) eps_ex} delta_ex(eps_ex) <= delta, found by bisection on eps_ex
    and rounded up (so the answer is a valid bound).
    """
    check_arguments(noise_multiplier, sampling_rate, steps, delta, group_size)
    if noise_multiplier == 0 and steps != 0:
        return math.inf
    if steps == 0:
        return 0.0
    G = int(group_size)
    pld = _composed_step_pld(("poisson", float(noise_multiplier), float(sampling_rate)), int(steps), float(discretization))
    if G == 1:
        return float(pld.get_epsilon_for_delta(delta))

    log_delta = math.log(delta)

    def ok(eps_ex: float) -> bool:
        d_ex = float(pld.get_delta_for_epsilon(eps_ex))
        # G e^{(G-1) eps_ex} delta_ex <= delta, in logs (no overflow).
        return d_ex <= 0 or math.log(G) + (G - 1) * eps_ex + math.log(d_ex) <= log_delta

    # The G = 1 epsilon at delta / G is a lower bound: the condition needs
    # delta_ex <= delta / G at least.
    lo = float(pld.get_epsilon_for_delta(delta / G))
    if ok(lo):
        return G * lo
    hi = max(2 * lo, 1e-3)
    while not ok(hi):
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            return math.inf
    # Bisection to a relative width of 1e-6 in eps_ex; return the feasible end.
    while hi - lo > 1e-6 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return G * hi


def library_versions() -> dict[str, str]:
    """Versions of the accounting libraries (for plans and ledgers)."""
    import importlib.metadata as md

    return {"dp-accounting": md.version("dp-accounting"), "numpy": np.__version__}
