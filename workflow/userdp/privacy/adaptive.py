"""Adaptive clipping at user level: the clip norm follows a quantile of the units' gradient norms, accounted.

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with
Adaptive Clipping" (NeurIPS 2021, arXiv 1905.03871), applied to DP-SGD's
units: examples (ELS) or users (ULS). Step t clips at C_t and releases, beside
the noisy clipped sum sum_u clip(g_u, C_t) + N(0, (sigma_g C_t)^2 I), a noisy
count of the sampled units whose norm is at most C_t, centred so that one unit
moves it by at most 1/2 (as TensorFlow Privacy's quantile estimator does):

    s_t = sum_u (1[||g_u|| <= C_t] - 1/2) + N(0, sigma_b^2),   b_t = s_t / m + 1/2,
    C_{t+1} = C_t exp(-eta (b_t - gamma)),

m the step's public divisor (the expected batch), gamma the target quantile,
eta the learning rate of the geometric update; b_t estimates the fraction of
units left unclipped. C_{t+1} is post-processing of released values.

Accounting. Whitened by its noise, the pair (clipped sum / (sigma_g C_t),
s_t / sigma_b) moves by at most sqrt(sigma_g^-2 + (2 sigma_b)^-2) per unit, so
one step is the Gaussian mechanism with noise multiplier

    sigma = (sigma_g^-2 + (2 sigma_b)^-2)^(-1/2)

(Andrew et al., Theorem 1). A ULS user is one unit: the step is the
Poisson-subsampled Gaussian at sigma. An ELS user with k sampled examples
moves the pair by at most k / sigma (triangle inequality): the
mixture-of-Gaussians event at sigma, as without adaptive clipping. So the
plan's calibrated noise multiplier and its dp_event stay exactly those of
fixed clipping; what changes is that the gradient gets the larger sigma_g =
(sigma^-2 - (2 sigma_b)^-2)^(-1/2) and the count gets sigma_b. The count's
noise is given relative to the divisor (`count_noise` = sigma_b / m, the std
of b_t; Andrew et al. suggest m / 20, i.e. 0.05), so sigma_g is finite only
when 2 sigma_b > sigma: `gradient_noise_multiplier` refuses otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..errors import PrivacyError

#: The plan's `clipping` value of adaptive (flat) clipping.
ADAPTIVE = "adaptive"
#: The keys of privacy.adaptive (and of the plan's and ledger's `adaptive_clipping`).
KEYS = ("quantile", "learning_rate", "count_noise")


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """privacy.adaptive: the target quantile gamma, the geometric learning rate eta, the count's noise sigma_b / m."""

    quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise PrivacyError(f"privacy.adaptive.quantile is {self.quantile}; give the target fraction of units "
                               "left unclipped, in (0, 1) (0.5: the median norm).")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise PrivacyError(f"privacy.adaptive.learning_rate is {self.learning_rate}; give a finite number > 0 "
                               "(0.2 in Andrew et al.).")
        if not (self.count_noise > 0 and math.isfinite(self.count_noise)):
            raise PrivacyError(f"privacy.adaptive.count_noise is {self.count_noise}; give the std of the noisy "
                               "unclipped fraction, a finite number > 0 (0.05 in Andrew et al.).")

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> "AdaptiveClipping":
        """From privacy.adaptive (or a plan's `adaptive_clipping`); missing keys take the defaults."""
        record = dict(record or {})
        unknown = sorted(set(record) - set(KEYS))
        if unknown:
            raise PrivacyError(f"privacy.adaptive has unknown key(s) {unknown}; allowed: {', '.join(KEYS)}.")
        try:
            return cls(**{k: float(v) for k, v in record.items()})
        except (TypeError, ValueError):
            raise PrivacyError(f"privacy.adaptive is {record!r}; each of {', '.join(KEYS)} must be a number.") from None

    def record(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in KEYS}

    def count_std(self, divisor: float) -> float:
        """sigma_b: the std of the noise on the centred count s_t, for a step divided by `divisor` (m)."""
        return float(self.count_noise) * float(divisor)

    def gradient_noise_multiplier(self, sigma: float, divisor: float) -> float:
        """sigma_g with sigma^-2 = sigma_g^-2 + (2 sigma_b)^-2: the clipped sum's noise multiplier that, with the
        count's noise sigma_b, makes one step the Gaussian mechanism at the accounted `sigma`."""
        sigma, sigma_b = float(sigma), self.count_std(divisor)
        rest = sigma ** -2 - (2.0 * sigma_b) ** -2
        if not rest > 0:
            raise PrivacyError(
                f"adaptive clipping: the count's noise sigma_b = count_noise * m = {self.count_noise:g} * "
                f"{float(divisor):.6g} = {sigma_b:.6g} spends the whole step's budget (it needs 2 sigma_b > sigma = "
                f"{sigma:.6g}); raise privacy.adaptive.count_noise above {sigma / (2.0 * float(divisor)):.6g} "
                "(the gradient's noise grows as it nears that), or use a larger batch (m).")
        return float(rest ** -0.5)

    def noisy_fraction(self, released_count: float, divisor: float) -> float:
        """b_t = s_t / m + 1/2 from the released centred count s_t."""
        return float(released_count) / float(divisor) + 0.5

    def next_clip_norm(self, clip_norm: float, noisy_fraction: float) -> float:
        """C_{t+1} = C_t exp(-eta (b_t - gamma))."""
        return float(clip_norm) * math.exp(-float(self.learning_rate) * (float(noisy_fraction) - float(self.quantile)))


def of_config(privacy: Mapping[str, Any]) -> AdaptiveClipping | None:
    """The adaptive clipping of a privacy.* section: None unless privacy.clipping is "adaptive"."""
    if privacy.get("clipping") != ADAPTIVE:
        return None
    return AdaptiveClipping.from_record(privacy.get("adaptive"))
