"""Noise calibration: the smallest noise multiplier that meets (epsilon, delta).

Contract (docs/method.md section 6): sigma is the smallest noise multiplier whose
accounted epsilon at delta (pessimistic PLD estimate at the fine
discretization 1e-4) is <= the target, to relative tolerance `tolerance`
(1e-3) in sigma. The answer is certified at the fine discretization: sigma
itself meets the target and sigma / (1 + tolerance) was evaluated and does
not.

Why it is fast. One accountant call at discretization 1e-4 costs 0.3-3 s at
q = 0.01, T = 1000 (the MoG PLD construction in `accounting` is already
vectorised). A root search that evaluates only there needs 10-20 calls. We
search coarse to fine instead:

1. an initial guess from the central-limit (mu-GDP) approximation of the
   composed mechanism, whose per-step chi-square divergence is closed form
   for both the MoG and the subsampled Gaussian;
2. level A (coarse discretization, ~1e-2): a bracketed log-log secant
   search to relative width 3e-3, each call ~50 ms;
3. level B (1e-3): the same to 3e-4, starting from level A's bracket;
4. level C (1e-4): two calls in the usual case: level B's upper end
   (feasible, because a finer pessimistic PLD gives a smaller epsilon, and
   epsilon_achieved is reported from this call) and one point just below
   sigma / (1 + tolerance) that certifies the lower end.

Each level's pessimistic estimate upper-bounds the next finer one, so a coarse
upper end is feasible at the finer level; the finer level only has to move
the bracket down by the (small, second-order) discretization error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Sequence

from scipy import optimize, stats

import dp_accounting

from ..errors import AccountingLimitError, PrivacyError
from . import accounting
from .accounting import FINE_DISCRETIZATION, check_arguments
from .mechanism import Mechanism

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 1e-3
DEFAULT_MAX_NOISE = 500.0


@dataclasses.dataclass
class CalibrationResult:
    """Outcome of `calibrate`; field names follow the plan JSON."""

    method: str
    epsilon: float
    delta: float
    sampling_rate: float
    steps: int
    group_size: int
    noise_multiplier: float
    epsilon_achieved: float
    accountant: str
    tolerance: float
    discretization: float
    #: The certified bracket at the fine level: lower end infeasible, upper end = noise_multiplier.
    noise_lower: float
    evaluations: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- initial guess


def _gdp_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP."""
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def initial_guess(mechanism: Mechanism, epsilon: float, delta: float) -> float:
    """Rough sigma from the CLT (mu-GDP) approximation of T composed steps.

    Only a starting point for the search (it is typically within 10-30%):
    the per-step chi-square divergence (`Mechanism.log_chi2_step`, closed
    form) that T steps compose to the mu of mu-GDP meeting (epsilon, delta).
    The group-privacy baseline aims at its example-level target
    (`Mechanism.calibration_target`).
    """
    mech, epsilon, delta = mechanism.calibration_target(epsilon, delta)
    try:
        # mu* with delta_mu(epsilon) = delta (delta increases with mu).
        gap = lambda lm: math.log(max(_gdp_delta(math.exp(lm), epsilon), 1e-300)) - math.log(delta)  # noqa: E731
        try:
            log_mu = optimize.brentq(gap, -12, 6)
        except ValueError:  # a tiny target (epsilon ~ 1e-6): mu below e^-12; search further down
            log_mu = optimize.brentq(gap, -40, 6)
        target_log_chi2 = 2 * log_mu - math.log(mech.steps)
        f = lambda ls: mech.log_chi2_step(math.exp(ls)) - target_log_chi2  # noqa: E731
        lo, hi = math.log(1e-2), math.log(1e4)
        # No root in the bracket: start at the end the target lies beyond (a
        # start at a tiny sigma against a large sensitivity makes PLDs huge).
        if f(hi) > 0:
            return 1e4
        if f(lo) < 0:
            return 1e-2
        return float(math.exp(optimize.brentq(f, lo, hi)))
    except (ValueError, OverflowError, ZeroDivisionError):
        return 1.0


# ---------------------------------------------------------------- one level of the search


class _Level:
    """Bracketed search for the root of log f(s) = log target at one discretization.

    Keeps the smallest feasible s (f <= target) and the largest infeasible s
    seen; probes next to the log-log secant estimate of the root, just on the
    side that shortens the bracket, so that a good estimate closes the bracket
    in one or two probes. Falls back to geometric bisection when the secant
    stalls.
    """

    def __init__(self, f: Callable[[float], float], target: float, slope: float, name: str):
        self.f, self.target, self.slope, self.name = f, target, slope, name
        self.hi: tuple[float, float] | None = None  # (s, f(s)) feasible
        self.lo: tuple[float, float] | None = None  # infeasible
        self.calls = 0
        self._last: tuple[float, float] | None = None
        #: Probes the accountant refused (memory bound): read as infeasible, never as certified.
        self.refused: dict[float, AccountingLimitError] = {}

    def probe(self, s: float) -> float:
        try:
            e = self.f(s)
        except AccountingLimitError as exc:
            # A PLD too large to build means a privacy loss in the hundreds: far
            # from a feasible sigma in every case met so far. Reading it as
            # infeasible sends the search up; `calibrate` refuses to report a
            # bracket whose lower end is such a probe (it would not be certified).
            log.debug("level %s: sigma=%.6g refused by the accountant's memory bound", self.name, s)
            self.refused[s] = exc
            e = math.inf
        self.calls += 1
        log.debug("level %s: sigma=%.6g eps=%.6g", self.name, s, e)
        if self._last is not None and math.isfinite(e) and math.isfinite(self._last[1]) and e > 0 and self._last[1] > 0:
            ds = math.log(s) - math.log(self._last[0])
            if abs(ds) > 1e-9:
                b = (math.log(e) - math.log(self._last[1])) / ds
                if b < -1e-3:
                    self.slope = b
        self._last = (s, e)
        if e <= self.target:
            if self.hi is None or s < self.hi[0]:
                self.hi = (s, e)
        elif self.lo is None or s > self.lo[0]:
            self.lo = (s, e)
        return e

    def done(self, rtol: float) -> bool:
        return self.hi is not None and self.lo is not None and self.hi[0] <= self.lo[0] * (1 + rtol)

    def _one_sided(self, s: float, e: float) -> float:
        if not math.isfinite(e):
            return 4 * s  # infeasible, no usable value: go up
        if e <= 0:
            # Feasible with epsilon 0 (delta covers the whole privacy curve, near-vacuous settings): the
            # root is below; going up here would probe above the feasible end for ever.
            return s / 4
        return s * (self.target / e) ** (1 / self.slope)

    def estimate(self) -> float:
        lt = math.log(self.target)
        if self.hi is not None and self.lo is not None:
            (sh, eh), (sl, el) = self.hi, self.lo
            if math.isfinite(el) and el > 0 and eh > 0:
                x0, x1, y0, y1 = math.log(sl), math.log(sh), math.log(el) - lt, math.log(eh) - lt
                if y0 != y1:
                    return math.exp(x0 - y0 * (x1 - x0) / (y1 - y0))
            return math.sqrt(sh * sl)
        if self.hi is not None:
            return max(self._one_sided(*self.hi), self.hi[0] / 4)
        assert self.lo is not None
        return min(self._one_sided(*self.lo), self.lo[0] * 4)

    def solve(self, rtol: float, max_sigma: float, margin: float = 0.25, max_calls: int = 60) -> None:
        """Probe until the bracket's relative width is <= rtol.

        In log sigma, with tau = log(1 + rtol): when the root estimate lies
        more than margin * tau inside the closing window of one end (hi - tau
        or lo + tau), probe exactly there: a right estimate closes the bracket
        in that one probe. Otherwise probe tau/2 above the estimate (a feasible
        point near the root, after which hi - tau closes it). Geometric
        bisection when the bracket stops shrinking.
        """
        tau = math.log1p(rtol)
        eps_in = 1e-9  # stay strictly inside the closing window (rounding)
        widths: list[float] = []
        while not self.done(rtol):
            if self.calls >= max_calls:  # pragma: no cover - would be a bug
                raise RuntimeError(f"calibration did not converge at level {self.name}: {self.lo} {self.hi}")
            if self.hi is None and self.lo is not None and self.lo[0] >= max_sigma * (1 - 1e-9):
                return  # infeasible up to the maximum; the caller reports it
            u = math.log(self.estimate())
            a = math.log(self.lo[0]) if self.lo is not None else -math.inf
            b = math.log(self.hi[0]) if self.hi is not None else math.inf
            if self.hi is not None and u > b - tau + margin * tau:
                p = b - tau + eps_in
            elif self.lo is not None and u < a + tau - margin * tau:
                p = a + tau - eps_in
            else:
                p = u + tau / 2
            if self.lo is not None and self.hi is not None:
                width = b - a
                widths.append(width)
                if len(widths) >= 3 and widths[-1] > 0.5 * widths[-3]:
                    p = 0.5 * (a + b)  # stalled: bisect
                    widths.clear()
                p = min(max(p, a + 1e-3 * width), b - 1e-3 * width)
            elif self.hi is not None:
                p = max(p, b - math.log(4.0))  # never jump far below a feasible point
            else:
                p = min(p, a + math.log(4.0), math.log(max_sigma))
            self.probe(max_sigma if p >= math.log(max_sigma) - 1e-12 else math.exp(p))


# ---------------------------------------------------------------- public entry point


def check_not_vacuous(mechanism: Mechanism, delta: float, cell: str | None = None) -> None:
    """PrivacyError when delta >= the probability that a user's data is used at all (no noise is needed).

    Without noise the outputs on neighbouring datasets differ only when the
    user's data is sampled, which happens with probability
    p = 1 - (1 - q)^(T G) (`Mechanism.participation_probability`; ULS: G = 1),
    so (0, delta)-DP holds with sigma = 0 for every delta >= p: the guarantee
    is vacuous, there is no smallest noise to find, and a search would only
    chase sigma towards 0 (unbounded PLDs).
    """
    p = mechanism.participation_probability()
    if p is None or delta < p:
        return
    where = f" for {cell}" if cell else ""
    units = "its examples" if mechanism.accounting_group_size > 1 else "the user"
    raise PrivacyError(
        f"delta = {delta:.3g} is at least the probability {p:.3g} that one user's data is used at all{where} "
        f"({mechanism.describe()}: 1 - (1 - q)^(T x {mechanism.accounting_group_size}), {units} sampled in some "
        f"step). Every noise multiplier, even 0, then gives (0, delta)-DP: the guarantee is vacuous and there is "
        "no noise to calibrate. Use a delta far below that probability (the default 1/N^1.1 with N train users, "
        "privacy.delta / privacy.delta_exponent; command line: --delta), or sample more: a larger sampling rate "
        "or more steps (in the pipeline: a larger compute budget or a smaller G, i.e. more users per step)."
    )


def _epsilon_fn(mechanism: Mechanism, delta: float, d: float, extra: tuple = ()) -> Callable[[float], float]:
    """sigma -> the mechanism's epsilon at delta and discretization d, a failure of dp-accounting at an extreme
    probe read as "not private enough".

    dp-accounting's PLD construction can break down where the privacy loss
    is astronomically large (a truncation bound comes back None; the one
    mixture that did so at ordinary sigmas, ELS at q = 1, is now composed as
    the Gaussian mechanism it is: accounting._certain_sensitivity). Such a probe is far from
    any feasible sigma, so treating it as epsilon = inf only sends the
    search upward; the returned sigma is still certified by a successful
    evaluation, never by this fallback.
    """
    def g(s: float) -> float:
        try:
            return mechanism.epsilon(s, delta, extra_events=extra, discretization=d)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, FloatingPointError) as exc:
            log.debug("accounting failed at sigma = %g (%s: %s); treating it as infeasible", s, type(exc).__name__, exc)
            return math.inf
    return g


def search_levels(epsilon: float, discretization: float = FINE_DISCRETIZATION,
                  tolerance: float = DEFAULT_TOLERANCE) -> list[tuple[float, float, str]]:
    """The levels of `calibrate`'s search, coarse to fine: (discretization, relative bracket width, name).

    The coarse discretizations scale with the target, so that their error stays a small fraction of it, and
    are never finer than `discretization`; the last level is `discretization` itself at `tolerance`. Level A
    stops at 3e-3 (or `tolerance` if wider), B at 3e-4 (or `tolerance` if narrower).
    """
    d_a = max(discretization, min(1e-2, 5e-3 * epsilon))
    d_b = max(discretization, min(1e-3, d_a / 3))
    levels = [(d_a, max(3e-3, tolerance), "A"), (d_b, min(3e-4, tolerance), "B"), (discretization, tolerance, "C")]
    levels = [lv for i, lv in enumerate(levels) if lv[0] > discretization or i == len(levels) - 1]
    return [lv for i, lv in enumerate(levels) if i == 0 or lv[0] < levels[i - 1][0]]


def calibrate(
    mechanism: Mechanism,
    epsilon: float,
    delta: float,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    max_noise_multiplier: float = DEFAULT_MAX_NOISE,
    discretization: float = FINE_DISCRETIZATION,
    cell: str | None = None,
    extra_events: Sequence[dp_accounting.DpEvent] = (),
) -> CalibrationResult:
    """Smallest noise multiplier meeting (epsilon, delta) for `mechanism`.

    mechanism: `mechanism.ELS` (tight MoG accountant), `ULS`, or
    `GroupPrivacyELS` (comparison only). epsilon = inf returns sigma = 0 (the
    non-private reference). Raises PrivacyError, naming `cell` when given, if
    no sigma up to `max_noise_multiplier` meets the target.

    extra_events: fixed releases (e.g. the DP contribution statistics,
    `LaplaceDpEvent`) composed with the T steps: epsilon is then the TOTAL
    budget, and sigma the smallest noise whose composition with them meets
    it (larger than without them). Every level of the search composes them
    at its own discretization, so the bracketing and the certification at
    the fine level are unchanged.
    """
    start = time.perf_counter()
    where = f" for {cell}" if cell else ""
    T, G, q = int(mechanism.steps), int(mechanism.group_size), float(mechanism.sampling_rate)
    check_arguments(None, q, T, delta, G, epsilon=epsilon)
    if not (0 < tolerance < 0.5):
        raise PrivacyError(f"calibration tolerance is {tolerance}; it must be in (0, 0.5), e.g. 1e-3.")
    extra = tuple(extra_events)
    if extra:
        mechanism.epsilon(1.0, delta, steps=0, extra_events=extra)  # refuses events this mechanism cannot compose
    base = dict(
        method=mechanism.name, epsilon=float(epsilon), delta=float(delta), sampling_rate=q, steps=T, group_size=G,
        accountant=mechanism.accountant, tolerance=tolerance, discretization=discretization,
    )
    fixed_eps = accounting.fixed_events_epsilon(extra, delta, discretization) if extra else 0.0
    if math.isinf(epsilon) or T == 0:
        return CalibrationResult(
            **base, noise_multiplier=0.0, epsilon_achieved=(fixed_eps if T == 0 else math.inf), noise_lower=0.0,
            seconds=time.perf_counter() - start,
        )
    check_not_vacuous(mechanism, delta, cell)
    if extra and fixed_eps >= epsilon:
        raise PrivacyError(
            f"the fixed releases composed with training{where} already spend epsilon = {fixed_eps:.4g} "
            f">= the target {epsilon:g} at delta = {delta:.3g}: no noise level leaves room for training."
        )

    levels = search_levels(epsilon, discretization, tolerance)

    # With fixed releases the training part gets roughly what they leave
    # (composition at a fixed delta is sub-additive, so this guess is high);
    # only a starting point.
    guess = min(initial_guess(mechanism, epsilon - fixed_eps, delta), max_noise_multiplier)
    slope = -1.0
    counts: dict[str, int] = {}
    prev: _Level | None = None
    for d, rtol, name in levels:
        lvl = _Level(_epsilon_fn(mechanism, delta, d, extra), epsilon, slope, name)
        if prev is None:
            lvl.probe(guess)
        else:
            # The coarser level's feasible end is feasible here too (up to rounding).
            lvl.probe(prev.hi[0])
        lvl.solve(rtol, max_noise_multiplier)
        counts[f"d={d:g}"] = lvl.calls
        if lvl.hi is None:
            # Infeasible up to the maximum at this level; confirm at the fine level.
            try:
                fine = _epsilon_fn(mechanism, delta, discretization, extra)(max_noise_multiplier)
            except AccountingLimitError as exc:
                raise AccountingLimitError(
                    f"calibration{where} ({mechanism.describe()}) found no feasible noise multiplier up to "
                    f"privacy.max_noise_multiplier = {max_noise_multiplier:g}, and the accountant cannot evaluate "
                    f"that maximum within its memory bound: {exc} At this step count and sampling rate the target "
                    f"epsilon = {epsilon:g} at delta = {delta:.3g} is far out of reach: use fewer steps or a smaller "
                    "sampling rate (in the pipeline: a smaller compute budget, or more steps for it), or a larger "
                    "epsilon."
                ) from exc
            if fine > epsilon:
                fixed_note = (f" That epsilon includes fixed releases worth {fixed_eps:.4g} on their own "
                              "(the DP contribution statistics)." if extra else "")
                raise PrivacyError(
                    f"no noise multiplier up to privacy.max_noise_multiplier = {max_noise_multiplier:g} reaches "
                    f"epsilon = {epsilon:g} at delta = {delta:.3g}{where} ({mechanism.describe()}): sigma = {max_noise_multiplier:g} gives epsilon = {fine:.4g}."
                    f"{fixed_note} "
                    "The target is too strict for this sampling rate and step count: lower the sampling rate (in the "
                    "pipeline: more steps for the same compute budget, or a smaller budget, both give smaller "
                    "batches), fewer steps at this rate, a larger epsilon, or raise privacy.max_noise_multiplier "
                    "(command line: --max-noise-multiplier)."
                )
            # Coarse pessimism only: carry the maximum on as the feasible end.
            lvl.hi = (max_noise_multiplier, fine)
        slope = lvl.slope
        prev = lvl

    assert prev is not None and prev.hi is not None
    sigma, eps_achieved = prev.hi
    lower = prev.lo[0] if prev.lo is not None else 0.0
    if prev.lo is not None and prev.lo[0] in prev.refused:
        # The bracket's lower end was never evaluated: sigma may not be the smallest. Refuse rather than
        # report an uncertified (too large) noise multiplier.
        raise AccountingLimitError(
            f"calibration{where} ({mechanism.describe()}, epsilon = {epsilon:g}, delta = {delta:.3g}) cannot "
            f"certify its answer: sigma = {sigma:.6g} meets the target, but the accountant refused to evaluate "
            f"sigma = {lower:.6g} just below it: {prev.refused[prev.lo[0]]} The smallest noise multiplier lies "
            "where the privacy loss is too large to account for within the memory bound, which happens when "
            "delta is close to the probability that a user is sampled at all (a near-vacuous guarantee): use a "
            "smaller delta, or a larger sampling rate or more steps (in the pipeline: more users per step)."
        )
    result = CalibrationResult(
        **base, noise_multiplier=float(sigma), epsilon_achieved=float(eps_achieved), noise_lower=float(lower),
        evaluations=counts, seconds=time.perf_counter() - start,
    )
    log.info(
        "calibrated %s%s: sigma=%.6g (eps=%.6g <= %.6g, delta=%.3g, q=%.4g, T=%d, G=%d) in %.2fs, calls %s",
        mechanism.name, where, sigma, eps_achieved, epsilon, delta, q, T, G, result.seconds, counts,
    )
    return result
