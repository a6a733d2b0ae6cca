"""Differentially private contribution statistics for choosing G (docs/method.md section 7).

The G rules (ELS median, ULS predicted SNR) read the train users' example
counts n_u, which are private. By default they are treated as public, as in
the study. With `privacy.contribution_stats.private: true` the rules read
only this release instead:

* Mechanism: a histogram of the train users' n_u over power-of-two bins
  [2^k, 2^(k+1)), k = 0..max_log2 (the last bin is open: [2^max_log2, inf)),
  plus independent Laplace noise of scale b = 1 / eps_stats in every bin.
* Privacy: under add/remove-one-user adjacency one user changes exactly one
  bin by 1, so the histogram has L1 sensitivity 1 and the release is
  eps_stats-DP (pure DP). Only the changed coordinate carries privacy loss,
  so its privacy-loss distribution is the one-dimensional Laplace
  mechanism's: dp-accounting's `LaplaceDpEvent(noise_multiplier=b)`
  (scale b per unit of L1 sensitivity; `PLDAccountant` builds it with
  `from_laplace_mechanism(parameter=b)`).
* The noise is drawn ONCE per dataset (seeded by the config seed and the
  dataset name) and written to results/data/{dataset}/contributions_dp.json
  without the true counts, so every cell of the dataset uses the same
  release and the same event is composed into every cell's epsilon.
* Everything after the release is post-processing (free): noisy counts are
  rounded to integers and clipped at 0 (`weights`); the rules then read the
  weights alone.

The rules on the histogram (`NoisyHistogram`, a `contributions.Contributions`
like the exact counts, with the same definitions): the p-quantile is the LOWER
edge 2^k of the first bin whose cumulative weight reaches p * total; the ELS
median rule takes G = that edge at p = 1/2; the SNR rule takes candidates
G = 1, 2, 4, ... up to the edge at `snr_max_quantile` and evaluates
mbar_G and mean_u rho(min(n_u, G)) with every user of bin k at its lower
edge 2^k (exact when counts are powers of two; otherwise an underestimate of
at most a factor 2 for bins below G, and exact for bins at or above G, whose
users all have min(n_u, G) = G). If the clipped histogram is empty (possible
only for tiny data and a tiny eps_stats) the rules fall back to G = 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

import dp_accounting

from ..errors import ConfigError, DataError, PrivacyError
from . import seed_secrecy
from .contributions import Contributions

MECHANISM = "laplace_histogram_log2"

#: Appended to the accountant's name in plans and ledgers when the release is composed in.
ACCOUNTANT_SUFFIX = "laplace_contribution_stats"

#: Config key (for messages).
KEY = "privacy.contribution_stats"


@dataclasses.dataclass(frozen=True)
class StatsSettings:
    """`privacy.contribution_stats` when the option is on."""

    epsilon: float
    max_log2: int


def settings(privacy: dict) -> StatsSettings | None:
    """The DP-statistics settings from the privacy config, or None when they are off (the default)."""
    cs = (privacy or {}).get("contribution_stats") or {}
    if not cs.get("private", False):
        return None
    eps = float(cs.get("epsilon", 0.1))
    max_log2 = int(cs.get("max_log2", 20))
    if not (eps > 0 and math.isfinite(eps)):
        raise ConfigError(f"{KEY}.epsilon is {eps}; it must be a finite number > 0 (e.g. 0.1).")
    if not (0 <= max_log2 <= 62):
        raise ConfigError(f"{KEY}.max_log2 is {max_log2}; it must be a whole number in [0, 62].")
    return StatsSettings(eps, max_log2)


def bin_lower_edges(max_log2: int) -> np.ndarray:
    """Lower edges 2^k, k = 0..max_log2, of the histogram's bins."""
    return np.left_shift(np.int64(1), np.arange(max_log2 + 1, dtype=np.int64))


def histogram(counts: Sequence[int] | np.ndarray, max_log2: int) -> np.ndarray:
    """Number of users per bin [2^k, 2^(k+1)) (last bin open); counts must be >= 1."""
    c = np.asarray(counts, dtype=np.int64)
    if c.size and c.min() < 1:
        raise DataError(f"contribution counts must be >= 1 to be binned; found {int(c.min())}.")
    # floor(log2 n) exactly: frexp gives n = m 2^e with m in [0.5, 1), so floor(log2 n) = e - 1
    # (exact for n < 2^53, where float64 holds n exactly).
    k = np.frexp(c.astype(np.float64))[1].astype(np.int64) - 1
    return np.bincount(np.minimum(k, max_log2), minlength=max_log2 + 1).astype(np.int64)


def laplace_event(epsilon: float) -> dp_accounting.DpEvent:
    """The release as a dp-accounting event: Laplace, scale 1/eps_stats per unit L1 sensitivity."""
    return dp_accounting.LaplaceDpEvent(noise_multiplier=1.0 / float(epsilon))


def release(
    counts: Sequence[int] | np.ndarray, epsilon: float, max_log2: int, seed: int, *, dataset: str, source: str
) -> dict[str, Any]:
    """The noisy histogram record written to contributions_dp.json (no true counts in it).

    Draws Laplace(0, 1/epsilon) noise once per bin from a numpy generator
    seeded with `seed`.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigError(f"{KEY}.epsilon is {epsilon}; it must be a finite number > 0.")
    true = histogram(counts, max_log2)
    rng = np.random.default_rng(seed)
    noisy = true + rng.laplace(0.0, 1.0 / epsilon, size=true.size)
    return {
        "dataset": dataset,
        "mechanism": MECHANISM,
        "description": (
            "Laplace-noised histogram of the train users' example counts over bins [2^k, 2^(k+1)), "
            "last bin open; L1 sensitivity 1 under add/remove-one-user adjacency, so epsilon-DP."
        ),
        "epsilon": float(epsilon),
        "noise_scale": 1.0 / float(epsilon),
        "dp_event": {"type": "LaplaceDpEvent", "noise_multiplier": 1.0 / float(epsilon)},
        "max_log2": int(max_log2),
        "bin_lower_edges": [int(x) for x in bin_lower_edges(max_log2)],
        "noisy_counts": [float(x) for x in noisy],
        "seed": int(seed),
        "count_source": source,
    }


def release_for_dataset(counts: Sequence[int] | np.ndarray, settings_cfg: dict, config_seed: int, *,
                        dataset: str, source: str, secret: bool = False) -> dict[str, Any]:
    """The release of one dataset from the `privacy.contribution_stats` settings.

    The seed is derived from the config seed and the dataset name, so the
    release is the same for every cell and every rerun; with `secret`
    (`privacy.secret_seeds`) it is fresh OS entropy, not written anywhere
    (a seed anyone can derive from the config would let them subtract the
    noise). The release is drawn once per dataset either way: every cell
    reads the same file.
    """
    import secrets

    from ..seeding import derive_seed

    st = settings({"contribution_stats": dict(settings_cfg, private=True)})
    assert st is not None
    seed = secrets.randbits(63) if secret else derive_seed(int(config_seed), "contribution_stats", dataset)
    record = release(counts, st.epsilon, st.max_log2, seed, dataset=dataset, source=source)
    if secret:
        record["seed"] = "secret"
    record.update(seed_secrecy.seeds_fields(secret))  # seeds_mode, guarantee_caveat (null when secret)
    return record


@dataclasses.dataclass
class NoisyHistogram(Contributions):
    """The released histogram after post-processing; the G rules read it through `Contributions`."""

    lower_edges: np.ndarray  # [K] int64, 2^k
    weights: np.ndarray      # [K] float, max(0, round(noisy count))
    epsilon: float
    file: str | None = None
    seeds_mode: str | None = None  # "secret" / "derived" (None: a release written before it was recorded)

    @classmethod
    def from_release(cls, record: dict, file: str | None = None) -> "NoisyHistogram":
        """Read a `release` record; DataError naming the file when it is malformed."""
        where = file or "contribution statistics release"
        try:
            edges = np.asarray(record["bin_lower_edges"], dtype=np.int64)
            noisy = np.asarray(record["noisy_counts"], dtype=float)
            eps = float(record["epsilon"])
            mech = record["mechanism"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where} is not a contribution statistics release ({exc}); rerun rule contribution_stats_dp.") from exc
        if mech != MECHANISM or edges.shape != noisy.shape or edges.size == 0 or not (eps > 0):
            raise DataError(f"{where}: unexpected mechanism {mech!r} or malformed bins; rerun rule contribution_stats_dp.")
        # Post-processing: true bin counts are whole numbers >= 0.
        return cls(edges, np.maximum(np.round(noisy), 0.0), eps, file, record.get("seeds_mode"))

    @property
    def dp_events(self) -> tuple[dp_accounting.DpEvent, ...]:
        """The release's Laplace event, composed into every cell's epsilon."""
        return (laplace_event(self.epsilon),)

    def record(self) -> dict[str, Any]:
        """What plans and ledgers store about the release (enough to rebuild its DP event)."""
        return {
            "private": True,
            "mechanism": MECHANISM,
            "epsilon": self.epsilon,
            "dp_event": {"type": "LaplaceDpEvent", "noise_multiplier": 1.0 / self.epsilon},
            "file": self.file,
            # where the histogram's noise came from; derived: the guarantee does not hold against the config's holder
            **(seed_secrecy.seeds_fields(self.seeds_mode == seed_secrecy.SECRET) if self.seeds_mode else {}),
        }


def events_from_record(record: dict | None) -> tuple[dp_accounting.DpEvent, ...]:
    """The fixed DP events a plan/ledger `contribution_stats` record describes (empty when off)."""
    if not record or not record.get("private"):
        return ()
    ev = record.get("dp_event") or {}
    if ev.get("type") != "LaplaceDpEvent" or not (float(ev.get("noise_multiplier", 0)) > 0):
        raise PrivacyError(f"contribution_stats record has an unsupported DP event {ev!r}; expected a LaplaceDpEvent.")
    return (dp_accounting.LaplaceDpEvent(noise_multiplier=float(ev["noise_multiplier"])),)


def check_budget(stats_epsilon: float, epsilon: float, cell: str) -> None:
    """PrivacyError when the statistics alone spend the cell's epsilon."""
    if math.isfinite(epsilon) and stats_epsilon >= epsilon:
        raise PrivacyError(
            f"{cell}: {KEY}.epsilon = {stats_epsilon:g} is >= the cell's epsilon {epsilon:g}, so nothing is left "
            f"for training. Set {KEY}.epsilon well below the smallest grid epsilon (e.g. a tenth of it), or "
            f"turn the option off ({KEY}.private: false)."
        )
