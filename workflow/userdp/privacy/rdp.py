"""Renyi-DP (RDP) curves of the pipeline's events, for the private-selection bound.

The released model of a random-stopping cell (`selection.RandomStopping`) is
the best of a random number of runs; its guarantee is the RDP bound of
Papernot & Steinke 2022 ("Hyperparameter Tuning with Renyi Differential
Privacy", Theorems 2 and 6), which dp-accounting implements for its
`RepeatAndSelectDpEvent` in `RdpAccountant`. That accountant computes the RDP
of the Poisson-subsampled Gaussian (ULS) and of Laplace releases, but not of
the mixture-of-Gaussians step of ELS (G > 1). `mog_rdp` fills that gap by
numerical integration, and `epsilon` composes everything on one order grid:

* run events of ULS, Laplace releases and the repeat-and-select transform
  through dp-accounting (`RdpAccountant`, its own repeat-and-select formula);
* the MoG step as T times `mog_rdp`.

The integral is a trapezoid rule in log space on a grid of spacing sigma / 40
over the region that holds the integrand's mass, summed in blocks so that its
memory is bounded (`MAX_RDP_POINTS` bounds its time); tests compare it with the
closed form at G = 1 (dp-accounting's subsampled Gaussian) and with the
closed-form chi-square divergence at order 2 (`mechanism.ELS.log_chi2_step`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy import special

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from ..errors import AccountingLimitError, PrivacyError
from . import _dp_accounting_compat as compat
from . import accounting
from .mechanism import Mechanism

#: Renyi orders of every RDP computation here (dp-accounting's default grid up to 256, fractional orders near 1).
ORDERS: tuple[float, ...] = tuple(
    [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0,
     28.0, 32.0, 40.0, 48.0, 56.0, 64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0]
)

#: Grid points per sigma of the numerical integral (trapezoid rule on a Gaussian-like integrand).
POINTS_PER_SIGMA = 40


def _log_mixture_ratio(x: np.ndarray, sens: np.ndarray, logp: np.ndarray, sigma: float) -> np.ndarray:
    """log P(x)/Q(x) for P = sum_k p_k N(s_k, sigma^2), Q = N(0, sigma^2)."""
    z = logp[None, :] + (2 * x[:, None] * sens[None, :] - sens[None, :] ** 2) / (2 * sigma**2)
    return special.logsumexp(z, axis=1)


def _log_gauss(x: np.ndarray, sigma: float) -> np.ndarray:
    return -0.5 * (x / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))


#: Grid points of one order's integral above which it is refused (AccountingLimitError): the integral is built in
#: blocks of accounting.PLD_BLOCK points, so memory stays ~ PLD_BLOCK x components; this bounds the time.
MAX_RDP_POINTS = 1 << 23


def _check_points(n: int) -> None:
    if n > MAX_RDP_POINTS:
        raise AccountingLimitError(
            f"the RDP integral of the mixture-of-Gaussians step needs {n:,} grid points (at most {MAX_RDP_POINTS:,}): "
            "the noise is too small for the contribution bound G at this Renyi order. Use a larger noise multiplier "
            "or a smaller G, or the composed selection (PLD accountant) instead of random stopping.")


def _log_integral(lo: float, hi: float, h: float, log_integrand) -> float:
    """log of the trapezoid rule of exp(log_integrand(x)) on [lo, hi] at spacing h, in blocks of PLD_BLOCK points."""
    n = int(math.ceil((hi - lo) / h)) + 1
    _check_points(n)
    total = -math.inf
    for start in range(0, n, accounting.PLD_BLOCK):
        idx = np.arange(start, min(n, start + accounting.PLD_BLOCK))
        logf = log_integrand(lo + idx * h) + math.log(h)
        logf[idx == 0] -= math.log(2)  # trapezoid: half weight at both ends
        logf[idx == n - 1] -= math.log(2)
        total = np.logaddexp(total, special.logsumexp(logf))
    return float(total)


def mog_rdp(sigma: float, sensitivities: Sequence[float], probabilities: Sequence[float],
            orders: Sequence[float] = ORDERS) -> np.ndarray:
    """RDP at each order of one step of the MoG mechanism, add/remove neighbours (both directions).

    P = sum_k p_k N(s_k, sigma^2) (the user present, its contribution k ~ the
    mixture) and Q = N(0, sigma^2) (absent); the step's RDP at order a is
    max(D_a(P || Q), D_a(Q || P)). Memory is bounded (blocks of
    accounting.PLD_BLOCK grid points); AccountingLimitError above MAX_RDP_POINTS points.
    """
    if not sigma > 0:
        raise PrivacyError(f"noise multiplier is {sigma}; RDP needs sigma > 0.")
    sens = np.asarray(sensitivities, dtype=float)
    p = np.asarray(probabilities, dtype=float)
    keep = p > 0
    sens, logp = sens[keep], np.log(p[keep])
    smax = float(sens.max())
    h = sigma / POINTS_PER_SIGMA
    ratio = lambda x: _log_mixture_ratio(x, sens, logp, sigma)  # noqa: E731
    # Refused before any work when the largest order's grid is over the bound (the forward integral's is largest).
    _check_points(int(math.ceil((max(orders) * smax + 24 * sigma) / h)) + 1)
    out = np.empty(len(orders))
    for i, a in enumerate(orders):
        a = float(a)
        # D_a(P||Q): log int Q (P/Q)^a; the mass lies in [-12 sigma, a * s_max + 12 sigma].
        forward = _log_integral(-12 * sigma, a * smax + 12 * sigma, h,
                                lambda x: _log_gauss(x, sigma) + a * ratio(x)) / (a - 1)
        # D_a(Q||P): log int P (Q/P)^a = int Q exp((1-a) log P/Q); the mass lies where P or Q does.
        lo = -12 * sigma - (a * smax if logp.size and sens.min() > 0 else 0.0)
        backward = _log_integral(lo, smax + 12 * sigma, h,
                                 lambda x: _log_gauss(x, sigma) + (1 - a) * ratio(x)) / (a - 1)
        out[i] = max(forward, backward, 0.0)
    return out


def _rdp_of(event: dp_accounting.DpEvent, orders: Sequence[float]) -> np.ndarray:
    """RDP curve of `event`: dp-accounting's accountant, with MoG steps integrated here."""
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum((_rdp_of(e, orders) for e in event.events), np.zeros(len(orders)))
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * _rdp_of(event.event, orders)
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return np.zeros(len(orders))
    if isinstance(event, dp_accounting.dp_event.MixtureOfGaussiansDpEvent):
        # The far binomial tail lumped onto the largest sensitivity: a valid upper bound (accounting.prune_mixture).
        sens, probs = accounting.prune_mixture(event.sensitivities, event.sampling_probs)
        return mog_rdp(event.standard_deviation, sens, probs, orders)
    if isinstance(event, dp_accounting.dp_event.RepeatAndSelectDpEvent):
        return compat.rdp_repeat_and_select(list(orders), list(_rdp_of(event.event, orders)), float(event.mean),
                                            float(event.shape))
    acc = rdp_lib.RdpAccountant(list(orders))
    if not acc.supports(event):
        raise PrivacyError(f"the RDP accountant cannot account for {event!r}.")
    acc.compose(event)
    return acc.rdp


def epsilon(event: dp_accounting.DpEvent, delta: float, orders: Sequence[float] = ORDERS) -> float:
    """Epsilon at delta of `event` from its RDP curve (dp-accounting's RDP-to-DP conversion)."""
    if isinstance(event, dp_accounting.NonPrivateDpEvent) or _contains_non_private(event):
        return math.inf
    rdp = _rdp_of(event, orders)
    eps, _ = rdp_lib.compute_epsilon(list(orders), list(rdp), float(delta))
    return float(eps)


def _contains_non_private(event: dp_accounting.DpEvent) -> bool:
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return True
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(_contains_non_private(e) for e in event.events)
    inner = getattr(event, "event", None)
    return isinstance(inner, dp_accounting.DpEvent) and _contains_non_private(inner)


@dataclasses.dataclass(frozen=True)
class RandomStopping(Mechanism):
    """A run's mechanism seen through random-stopping selection: what `calibration.calibrate` calibrates.

    Its epsilon is the RDP bound of the selection (discretization is not
    used: RDP has none); its first guess is the composition of E[K] runs.
    """

    base: Mechanism | None = None
    selection: "selection.Selection | None" = None  # the Selection this run is released through

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.base.name

    @property
    def unit(self) -> str:  # type: ignore[override]
        return self.base.unit

    @property
    def accountant(self) -> str:  # type: ignore[override]
        return "rdp_" + self.base.accountant.removeprefix("pld_") + "+repeat_and_select"

    @property
    def accounting_group_size(self) -> int:
        return self.base.accounting_group_size

    def step_event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        return self.base.step_event(noise_multiplier)

    def dp_event(self, noise_multiplier: float, steps: int | None = None) -> dp_accounting.DpEvent:
        return self.selection.released_event([self.base.dp_event(noise_multiplier, steps)])

    def epsilon(self, noise_multiplier, delta, *, steps=None, extra_events=(),
                discretization=accounting.FINE_DISCRETIZATION) -> float:
        if steps == 0:  # the fixed releases alone (calibration's check of the extra events)
            return self.base.epsilon(noise_multiplier, delta, steps=0, extra_events=extra_events,
                                     discretization=discretization)
        event = self.selection.released_event([self.base.dp_event(noise_multiplier, steps)], extra_events)
        return epsilon(event, delta)

    def log_chi2_step(self, noise_multiplier: float) -> float:
        return self.base.log_chi2_step(noise_multiplier)

    def participation_probability(self) -> float | None:
        """Not one run's: a random number of runs may use a user (calibration's vacuity check is skipped)."""
        return None

    def calibration_target(self, epsilon, delta):
        return self.base.repeated(max(1, int(math.ceil(self.selection.mean_runs)))), epsilon, delta

    def describe(self) -> str:
        return (f"{self.base.describe()}, released by random stopping (mean {self.selection.mean_runs:g} runs, "
                f"shape {self.selection.shape:g})")
