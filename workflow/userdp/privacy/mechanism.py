"""The DP mechanisms of the pipeline as typed objects, built once and carried everywhere.

A mechanism is one method of sampling (ELS: examples of the bounded pool,
ULS: users) at a sampling rate q for T steps with contribution bound G. It
knows

* its sampling unit and how a compute budget K becomes a sampling rate
  (`for_budget`: the one place of docs/method.md section 5's formula);
* the dp-accounting event it runs at noise multiplier sigma (`dp_event`);
* its epsilon at delta, composed with fixed releases such as the DP
  contribution statistics (`epsilon`, through `accounting.epsilon`, which
  accounts for events, never for method names);
* the closed-form chi-square divergence of one step (`log_chi2_step`), which
  calibration uses for its starting point.

Plans store the calibrated event, training writes the event that ran into
the ledger, and learning-rate selection composes the events of its runs
(dp-accounting's own named-tuple serialisation: `event_to_json` /
`event_from_json`). The method name ("els", "uls") is parsed once, at the
boundary (`get`, `from_record`); nothing downstream dispatches on it.

`GroupPrivacyELS` and `GroupPrivacyRdpELS` are ELS accounted by group
privacy from the example-level guarantee (PLD, resp. RDP): the baselines of
the accounting comparison figure, never training methods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Iterable, Mapping

import numpy as np
from scipy import special

import dp_accounting
from dp_accounting import dp_event as dp_event_lib

from ..errors import PrivacyError
from . import accounting, banded


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a compute budget K buys at T steps: the expected batch and the sampling rate over the population."""

    unit: str  # "examples" (ELS) or "users" (ULS)
    expected_batch: float
    sampling_rate: float
    population: int  # N_G bounded examples (ELS) or N train users (ULS)
    expected_compute: float  # expected examples processed over the T steps (= K by construction)


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """T steps of Poisson-sampled DP-SGD at rate q with contribution bound G (abstract; see ELS, ULS)."""

    sampling_rate: float
    steps: int
    group_size: int = 1

    name: ClassVar[str]
    unit: ClassVar[str]
    accountant: ClassVar[str]

    def __post_init__(self) -> None:
        accounting.check_arguments(None, self.sampling_rate, self.steps, 0.5, self.group_size)

    # -------------------------------------------------------------- sampling

    @classmethod
    def sampling_for_budget(cls, compute_budget: float, steps: int, n_users: int, n_bounded: int,
                            mean_bounded: float) -> Sampling:
        """The expected batch and sampling rate that spend `compute_budget` examples in `steps` steps.

        n_bounded = N_G = sum_u min(n_u, G); mean_bounded = mbar_G = N_G / N.
        """
        raise NotImplementedError

    @classmethod
    def for_budget(cls, compute_budget: float, steps: int, group_size: int, n_users: int, n_bounded: int,
                   mean_bounded: float, where: str = "this cell") -> tuple["Mechanism", Sampling]:
        """The mechanism a cell runs and its sampling; PrivacyError naming `where` when the rate would exceed 1."""
        s = cls.sampling_for_budget(compute_budget, steps, n_users, n_bounded, mean_bounded)
        if s.sampling_rate > 1:
            pool = f"N_G = {s.population} bounded examples" if s.unit == "examples" else f"{s.population} train users"
            raise PrivacyError(
                f"{where}: sampling rate {s.sampling_rate:.4g} > 1 (expected batch {s.expected_batch:.4g} {s.unit} "
                f"per step from {pool}, G = {group_size}). Use more steps for this budget in grid.budgets or a "
                "smaller compute budget."
            )
        return cls(s.sampling_rate, int(steps), int(group_size)), s

    # -------------------------------------------------------------- accounting

    @property
    def accounting_group_size(self) -> int:
        """The G the accountant needs (ULS: 1, a sampled user is one clipped unit)."""
        return int(self.group_size)

    def step_event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        raise NotImplementedError

    def dp_event(self, noise_multiplier: float, steps: int | None = None) -> dp_accounting.DpEvent:
        """The event of `steps` (default T) steps at noise multiplier sigma.

        No noise (sigma = 0, the non-private reference) is `NonPrivateDpEvent`;
        no steps is `NoOpDpEvent`.
        """
        n = self.steps if steps is None else int(steps)
        if n <= 0:
            return dp_accounting.NoOpDpEvent()
        if not noise_multiplier > 0:
            return NON_PRIVATE
        return dp_accounting.SelfComposedDpEvent(self.step_event(float(noise_multiplier)), n)

    def epsilon(self, noise_multiplier: float, delta: float, *, steps: int | None = None,
                extra_events: Iterable[dp_accounting.DpEvent] = (),
                discretization: float = accounting.FINE_DISCRETIZATION) -> float:
        """User-level epsilon at delta of the steps composed with `extra_events` (fixed releases)."""
        accounting.check_arguments(noise_multiplier, self.sampling_rate, self.steps if steps is None else steps,
                                   delta, self.group_size)
        event = compose([*extra_events, self.dp_event(noise_multiplier, steps)])
        return accounting.epsilon(event, delta, discretization)

    def log_chi2_step(self, noise_multiplier: float) -> float:
        """log of the chi-square divergence of one step (closed form; calibration's starting point)."""
        raise NotImplementedError

    def participation_probability(self) -> float | None:
        """Probability that one user's data is used at all in the T steps: 1 - (1 - q)^(T G_acc).

        A user's G_acc accounted units (ELS: G examples, ULS: the user) are each
        Poisson-sampled with probability q in each of T steps. The outputs on
        neighbouring datasets differ only when one is used, so without any noise
        the mechanism is (0, this probability)-DP: a delta at or above it makes
        the guarantee vacuous (calibration refuses it). None when not known in
        closed form (then no such check is made).
        """
        n = int(self.steps) * int(self.accounting_group_size)
        q = float(self.sampling_rate)
        return 1.0 if q >= 1 else float(-math.expm1(n * math.log1p(-q)))

    def calibration_target(self, epsilon: float, delta: float) -> tuple["Mechanism", float, float]:
        """(mechanism, epsilon, delta) whose mu-GDP approximation gives calibration's first guess."""
        return self, epsilon, delta

    def repeated(self, runs: int) -> "Mechanism":
        """The mechanism of `runs` independent runs of this one composed (k runs of T steps: k T steps)."""
        return dataclasses.replace(self, steps=int(self.steps) * int(runs))

    def describe(self) -> str:
        return f"{self.name.upper()}, sampling rate {self.sampling_rate:.4g}, {self.steps} steps, G = {self.group_size}"


def _log_chi2_subsampled_gaussian(sigma: float, q: float) -> float:
    """log q^2 (exp(1/sigma^2) - 1): the subsampled Gaussian's one-step chi-square divergence."""
    return 2 * math.log(q) + math.log(math.expm1(min(1 / sigma**2, 700)))


@dataclasses.dataclass(frozen=True)
class ELS(Mechanism):
    """DP-SGD with example-level sampling: a user's G examples each sampled with probability q."""

    name: ClassVar[str] = "els"
    unit: ClassVar[str] = "examples"
    accountant: ClassVar[str] = "pld_mixture_of_gaussians"

    @classmethod
    def sampling_for_budget(cls, compute_budget, steps, n_users, n_bounded, mean_bounded) -> Sampling:
        expected_batch = compute_budget / steps
        q = expected_batch / n_bounded
        return Sampling(cls.unit, expected_batch, q, int(n_bounded), steps * q * n_bounded)

    def step_event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        """Mixture of Gaussians: sensitivity k ~ Binomial(G, q) of the user's examples in the step."""
        sens, probs = accounting.binomial_sensitivities(int(self.group_size), float(self.sampling_rate))
        return dp_accounting.dp_event.MixtureOfGaussiansDpEvent(float(noise_multiplier), sens, probs)

    def log_chi2_step(self, noise_multiplier: float) -> float:
        """chi2 = sum_{j,k} p_j p_k (exp(j k / sigma^2) - 1) over the Binomial(G, q) sensitivities."""
        sigma, q, G = noise_multiplier, self.sampling_rate, int(self.group_size)
        if G == 1:
            return _log_chi2_subsampled_gaussian(sigma, q)
        sens, probs = accounting.pruned_binomial_sensitivities(G, q)
        s = np.asarray(sens)
        lp = np.log(np.maximum(np.asarray(probs), 1e-300))
        jk = np.outer(s, s) / sigma**2
        mask = jk > 0  # the j*k = 0 terms contribute nothing
        terms = lp[:, None] + lp[None, :] + np.where(mask, np.log(np.expm1(np.minimum(jk, 700)) + 1e-300), -np.inf)
        return float(special.logsumexp(terms[mask]))


@dataclasses.dataclass(frozen=True)
class ULS(Mechanism):
    """DP-SGD with user-level sampling: each user sampled with probability q_u, clipped as one unit."""

    name: ClassVar[str] = "uls"
    unit: ClassVar[str] = "users"
    accountant: ClassVar[str] = "pld_poisson_subsampled_gaussian"

    @classmethod
    def sampling_for_budget(cls, compute_budget, steps, n_users, n_bounded, mean_bounded) -> Sampling:
        expected_batch = compute_budget / (steps * mean_bounded)
        q = expected_batch / n_users
        return Sampling(cls.unit, expected_batch, q, int(n_users), steps * q * n_users * mean_bounded)

    @property
    def accounting_group_size(self) -> int:
        return 1

    def step_event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        return dp_accounting.PoissonSampledDpEvent(float(self.sampling_rate),
                                                   dp_accounting.GaussianDpEvent(float(noise_multiplier)))

    def log_chi2_step(self, noise_multiplier: float) -> float:
        return _log_chi2_subsampled_gaussian(noise_multiplier, self.sampling_rate)


@dataclasses.dataclass(frozen=True)
class BandedULS(ULS):
    """ULS as user-level DP-FTRL: b-banded correlated noise, cyclic Poisson sampling (userdp.privacy.banded).

    sampling_rate is p, the rate within the step's partition (about N / b users; expected batch p N / b). The
    event is amplified BandMF's: ceil(T / b) compositions of the Poisson-subsampled Gaussian at sigma (the
    strategy's columns have unit norm), i.e. `equivalent`, DP-SGD's ULS at rate p for ceil(T / b) steps.
    """

    bands: int = 2

    accountant: ClassVar[str] = "pld_poisson_subsampled_gaussian+amplified_bandmf"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.bands, bool) or int(self.bands) != self.bands or self.bands < 2:
            raise PrivacyError(f"bands is {self.bands!r}; banded DP-FTRL needs a whole number >= 2.")

    @property
    def equivalent(self) -> ULS:
        """The DP-SGD mechanism with the same event: ULS at rate p for ceil(T / b) steps."""
        return ULS(self.sampling_rate, banded.rounds(self.steps, self.bands), 1)

    def dp_event(self, noise_multiplier: float, steps: int | None = None) -> dp_accounting.DpEvent:
        """ceil(n / b) rounds of the subsampled Gaussian for n steps (a user of partition 0 takes part in steps
        0, b, 2b, ... < n: ceil(n / b) of them, the most any user does)."""
        n = self.steps if steps is None else int(steps)
        return ULS.dp_event(self, noise_multiplier, banded.rounds(n, self.bands))

    def participation_probability(self) -> float | None:
        return self.equivalent.participation_probability()

    def calibration_target(self, epsilon, delta):
        return self.equivalent, epsilon, delta

    def repeated(self, runs: int) -> ULS:
        """k runs compose k ceil(T / b) rounds (not ceil(k T / b): each run starts its own cycle)."""
        return self if int(runs) == 1 else self.equivalent.repeated(runs)

    def describe(self) -> str:
        return (f"ULS with {self.bands}-banded DP-FTRL, rate {self.sampling_rate:.4g} within a partition, "
                f"{self.steps} steps ({banded.rounds(self.steps, self.bands)} per user at most)")


@dataclasses.dataclass(frozen=True)
class GroupPrivacyELS(ELS):
    """ELS accounted by group privacy from its example-level guarantee (comparison baseline only).

    The event that runs is the example-level Poisson-subsampled Gaussian; a
    group of G examples gets (G eps_ex, G e^{(G-1) eps_ex} delta_ex)
    (`accounting.group_privacy_epsilon`).
    """

    name: ClassVar[str] = "group"
    accountant: ClassVar[str] = "pld_poisson_subsampled_gaussian+group_privacy"
    rdp: ClassVar[bool] = False  # the example-level guarantee: PLD (GroupPrivacyRdpELS: RDP)

    # What runs is the example-level Poisson-subsampled Gaussian: ULS's step at the example rate.
    step_event = ULS.step_event
    log_chi2_step = ULS.log_chi2_step

    def epsilon(self, noise_multiplier, delta, *, steps=None, extra_events=(),
                discretization=accounting.FINE_DISCRETIZATION) -> float:
        if tuple(extra_events):
            raise PrivacyError("the group-privacy accountant is for the comparison figure only; it takes no extra events.")
        return accounting.group_privacy_epsilon(noise_multiplier, self.sampling_rate,
                                                self.steps if steps is None else int(steps), delta, self.group_size,
                                                discretization, rdp=self.rdp)

    def calibration_target(self, epsilon, delta):
        """The example-level target (eps/G, delta / (G e^{(G-1) eps/G})) of the subsampled Gaussian."""
        G = int(self.group_size)
        if G > 1:
            eps_ex = epsilon / G
            return self, eps_ex, delta / (G * math.exp((G - 1) * eps_ex))
        return self, epsilon, delta


@dataclasses.dataclass(frozen=True)
class GroupPrivacyRdpELS(GroupPrivacyELS):
    """ELS accounted by group privacy from its example-level RDP guarantee (comparison baseline only).

    The conversion of the study's authors' code (tensorflow_privacy's
    `compute_dp_sgd_privacy_lib`, user-level path): `accounting.group_privacy_epsilon` with rdp.
    """

    name: ClassVar[str] = "group_rdp"
    accountant: ClassVar[str] = "rdp_poisson_subsampled_gaussian+group_privacy"
    rdp: ClassVar[bool] = True


#: Training methods by the name configs, plans and ledgers use.
METHODS: dict[str, type[Mechanism]] = {"els": ELS, "uls": ULS}
#: Also accepted where the comparison baseline is allowed (the CLI, the accounting comparison).
ACCOUNTANTS: dict[str, type[Mechanism]] = {**METHODS, "group": GroupPrivacyELS, "group_rdp": GroupPrivacyRdpELS}


def get(name: str, *, comparison: bool = False) -> type[Mechanism]:
    """The mechanism class of a method name (PrivacyError naming the allowed ones)."""
    table = ACCOUNTANTS if comparison else METHODS
    try:
        return table[name]
    except (KeyError, TypeError):
        raise PrivacyError(f"method is {name!r}; allowed: {', '.join(table)}.") from None


def from_record(record: Mapping[str, Any], steps_key: str = "steps") -> Mechanism:
    """The mechanism a plan or ledger describes (its method, sampling_rate, steps, group_size, correlated_noise)."""
    args = (float(record["sampling_rate"]), int(record[steps_key]), int(record["group_size"]))
    if record.get("correlated_noise") is not None:
        if record["method"] != "uls":
            raise PrivacyError(f"a {record['method']!r} record with correlated_noise: banded DP-FTRL is ULS only.")
        return BandedULS(*args, bands=int(record["correlated_noise"]["bands"]))
    return get(record["method"])(*args)


# ---------------------------------------------------------------- events

#: The event of a run without noise (the non-private reference): no guarantee, epsilon = inf.
NON_PRIVATE = dp_accounting.NonPrivateDpEvent()


def compose(events: Iterable[dp_accounting.DpEvent]) -> dp_accounting.DpEvent:
    """One event for several releases (the single event itself when there is one)."""
    evs = [e for e in events if not isinstance(e, dp_accounting.NoOpDpEvent)]
    if not evs:
        return dp_accounting.NoOpDpEvent()
    return evs[0] if len(evs) == 1 else dp_accounting.ComposedDpEvent(evs)


def _plain(value: Any) -> Any:
    if hasattr(value, "_asdict"):  # a dp-accounting named-tuple wrapper
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def event_to_json(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """The event as JSON-ready data: dp-accounting's `to_named_tuple` fields, nested as mappings."""
    return _plain(event.to_named_tuple())


def event_from_json(data: Mapping[str, Any], where: str = "dp_event") -> dp_accounting.DpEvent:
    """Inverse of `event_to_json`; only dp-accounting's own event classes are built (PrivacyError otherwise)."""
    if not isinstance(data, Mapping) or data.get("module_name") != dp_event_lib.__name__:
        raise PrivacyError(f"{where} is not a dp-accounting event record: {data!r}")
    cls = getattr(dp_event_lib, str(data.get("class_name")), None)
    if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
        raise PrivacyError(f"{where}: unknown dp-accounting event class {data.get('class_name')!r}")

    def value(v: Any) -> Any:
        if isinstance(v, Mapping) and "class_name" in v:
            return event_from_json(v, where)
        if isinstance(v, list):
            return [value(x) for x in v]
        return v

    kwargs = {k: value(v) for k, v in data.items() if k not in ("module_name", "class_name")}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PrivacyError(f"{where}: cannot rebuild {cls.__name__} from {kwargs!r}: {exc}") from exc


def uls_mechanism(sampling_rate: float, steps: int, group_size: int = 1,
                  correlated: "banded.CorrelatedNoise | None" = None) -> ULS:
    """The ULS mechanism a cell with cohort rate q_u runs: DP-SGD's ULS, or with correlated noise (banded
    DP-FTRL) BandedULS at the rate p = b q_u within one of b partitions (the same expected cohort). A rate
    above 1 is refused (banded.check_rate names the key to change; `where` of the message: the caller's)."""
    if correlated is None:
        return ULS(sampling_rate, int(steps), int(group_size))
    return BandedULS(sampling_rate * correlated.bands, int(steps), int(group_size), bands=correlated.bands)


def cohort_rate(sampling_rate: float, correlated: "banded.CorrelatedNoise | None" = None) -> float:
    """The rate uls_mechanism runs at for cohort rate q_u: q_u, or b q_u within a partition (banded)."""
    return sampling_rate * (correlated.bands if correlated is not None else 1)
