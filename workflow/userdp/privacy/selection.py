"""How a cell's learning-rate runs become one released model, and that model's guarantee.

A cell trains k runs (one per learning rate of `training.learning_rates`) on
the same train users and releases the one with the lowest validation loss.
The choice is a function of all k models, so the released model's guarantee
is that of the whole selection, not of one run (docs/privacy.md). Three
accountings, `privacy.selection.accounting`:

* ``composed`` (default): the grid epsilon is the RELEASED model's guarantee.
  Each run is calibrated so that the k runs composed (k * T steps of the
  same mechanism, plus the DP contribution statistics once) meet it.
* ``per_run``: the grid epsilon is each run's own guarantee (the study's
  convention); the released model's guarantee is their composition, larger,
  and it is what ledgers, summaries and figures report as `epsilon`.
* ``random_stopping``: private selection (Papernot & Steinke 2022): the
  number of runs K is random (truncated negative binomial with mean
  `mean_runs` and shape `shape`: 1 geometric, 0 logarithmic),
  each run draws its learning rate uniformly from the candidates, and the
  best is released. Accounted in RDP with dp-accounting's
  `RepeatAndSelectDpEvent` (`rdp`, whose `RandomStopping` is the run's
  mechanism seen through the selection); each run is calibrated so that the
  selection meets the target. Better than composition for larger sweeps
  (its cost grows with log E[K], composition's with k). K is drawn by
  `draw_runs` with dp-accounting's own gamma for (mean, shape), so the
  number of runs that runs is the one the accountant assumes; the pipeline's
  job is userdp.evaluation.random_stopping.

`Selection` is built once from the config (`from_config`) and carried by the
planner (calibration target), the SNR rule (each candidate's sigma) and the
ledger of the released model (`released_epsilon`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

from ..errors import ConfigError, PrivacyError

if TYPE_CHECKING:  # the accountants are imported where they are used: rule params build a Selection at DAG time
    import dp_accounting

    from .mechanism import Mechanism

MODES = ("composed", "per_run", "random_stopping")
KEY = "privacy.selection"

#: What `epsilon` of a released model means, per mode (ledger `epsilon_meaning`, figure captions).
MEANING = {
    "composed": "released model: {runs} (target met by the selection)",
    "per_run": "released model: {runs} (the grid epsilon is each run's own)",
    "random_stopping": "released model: private selection among a random number of runs (mean {mean:g}, "
                       "Papernot-Steinke RDP bound)",
}


def mode_of(config: Mapping[str, Any]) -> str:
    """privacy.selection.accounting of a validated config (no accountant imported: rule files call it)."""
    return (config["privacy"].get("selection") or {}).get("accounting", "composed")


def one_job(config: Mapping[str, Any], epsilon: float) -> bool:
    """Whether a cell at `epsilon` is selected by one random-stopping job instead of a run per learning rate.

    Under random_stopping the private cells are (userdp.evaluation.random_stopping); the eps = inf
    references keep the learning-rate sweep (no privacy to account for).
    """
    return mode_of(config) == "random_stopping" and math.isfinite(float(epsilon))


@dataclasses.dataclass(frozen=True)
class Selection:
    """The selection of one cell: its accounting mode and the number of candidate learning rates."""

    mode: str = "composed"
    candidates: int = 1
    mean_runs: float | None = None  # random_stopping: E[K]
    shape: float | None = None  # random_stopping: truncated negative binomial shape

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"{KEY}.accounting is {self.mode!r}; allowed: {', '.join(MODES)}.")
        if int(self.candidates) < 1:
            raise ConfigError(f"{KEY}: a cell needs at least one learning rate (training.learning_rates).")
        if self.mode == "random_stopping":
            if self.mean_runs is None or not (self.mean_runs >= 1 and math.isfinite(self.mean_runs)):
                raise ConfigError(f"{KEY}.mean_runs is {self.mean_runs}; random stopping needs a finite mean >= 1.")
            if self.shape is None or not (self.shape >= 0 and math.isfinite(self.shape)):
                raise ConfigError(f"{KEY}.shape is {self.shape}; it must be a finite number >= 0 (1 geometric, "
                                  "0 logarithmic). The Poisson case (.inf) can draw zero runs, which the pipeline "
                                  "does not release.")

    @classmethod
    def from_config(cls, privacy: Mapping[str, Any], learning_rates: Sequence[float] | int) -> "Selection":
        """The selection of `privacy.selection` for a sweep over `learning_rates` (a list, or its length)."""
        cfg = dict(privacy.get("selection") or {})
        k = learning_rates if isinstance(learning_rates, int) else len(learning_rates)
        mode = cfg.get("accounting", "composed")
        if mode != "random_stopping":
            return cls(mode, int(k))
        mean = cfg.get("mean_runs")
        return cls(mode, int(k), float(k if mean is None else mean), float(cfg.get("shape", 1.0)))

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> "Selection":
        """Inverse of `record` (plans written before selections were recorded: one run per cell, per_run)."""
        if not record:
            return cls("per_run", 1)
        return cls(record["accounting"], int(record.get("candidates", 1)), record.get("mean_runs"),
                   record.get("shape"))

    def record(self) -> dict[str, Any]:
        """The plan's and ledger's `selection` field."""
        if self.mode == "per_run":  # the plan does not depend on the number of runs
            return {"accounting": self.mode}
        out: dict[str, Any] = {"accounting": self.mode, "candidates": int(self.candidates)}
        if self.mode == "random_stopping":
            out.update(mean_runs=self.mean_runs, shape=self.shape)
        return out

    # ------------------------------------------------------------ what the target means

    @property
    def target_is_released(self) -> bool:
        """Whether the grid epsilon is the released model's guarantee (every mode but per_run)."""
        return self.mode != "per_run"

    def meaning(self) -> str:
        runs = ("its one learning-rate run" if self.candidates == 1
                else f"the {self.candidates} learning-rate runs composed")
        return MEANING[self.mode].format(runs=runs, mean=self.mean_runs or 0)


    # ------------------------------------------------------------ accounting

    def released_event(self, run_events: Sequence[dp_accounting.DpEvent],
                       extra_events: Iterable[dp_accounting.DpEvent] = ()) -> dp_accounting.DpEvent:
        """The event of the released model: the runs' events under this selection, plus fixed releases once."""
        import dp_accounting

        from .mechanism import NON_PRIVATE, compose

        runs = list(run_events)
        if not runs:
            raise PrivacyError("a released model needs at least one run event.")
        if any(e == NON_PRIVATE for e in runs):
            return NON_PRIVATE
        if self.mode == "random_stopping":
            if any(e != runs[0] for e in runs[1:]):
                raise PrivacyError("random stopping repeats ONE mechanism: the runs' events differ "
                                   "(they must share the plan); rerun the cell.")
            return compose([*extra_events, dp_accounting.dp_event.RepeatAndSelectDpEvent(runs[0], self.mean_runs,
                                                                                self.shape)])
        return compose([*extra_events, *runs])

    def epsilon(self, event: dp_accounting.DpEvent, delta: float, discretization: float | None = None) -> float:
        """Epsilon at delta of a released event: RDP for random stopping, the PLD accountant otherwise.

        discretization: the PLD accountant's (default its fine level); RDP has none.
        """
        if self.mode == "random_stopping":
            from . import rdp

            return rdp.epsilon(event, delta)
        from . import accounting

        return accounting.epsilon(event, delta, discretization or accounting.FINE_DISCRETIZATION)

    def calibration_mechanism(self, mech: Mechanism) -> Mechanism:
        """The mechanism whose calibration to the target gives each run's sigma under this selection."""
        if self.mode == "per_run":
            return mech
        if self.mode == "composed":
            # k runs of T steps of one step event compose as k * T steps of it.
            return mech.repeated(int(self.candidates))
        from .rdp import RandomStopping

        return RandomStopping(mech.sampling_rate, mech.steps, mech.group_size, base=mech, selection=self)

    # ------------------------------------------------------------ the number of runs (random stopping)

    def _gamma(self) -> float:
        """The truncated negative binomial's gamma for `mean_runs` and `shape`: dp-accounting's own.

        The RDP accountant derives gamma from (mean, shape) for `RepeatAndSelectDpEvent`; drawing K with that
        same gamma makes the number of runs that runs the one the accountant assumes.
        """
        if self.mode != "random_stopping":
            raise PrivacyError(f"the number of runs is random only under random_stopping, not {self.mode}.")
        from ._dp_accounting_compat import gamma_truncated_negative_binomial

        return gamma_truncated_negative_binomial(float(self.shape), float(self.mean_runs))

    def _pmf(self) -> Iterator[float]:
        """P[K = 1], P[K = 2], ... of the number of runs (Papernot & Steinke 2022, section 2), without end."""
        gamma, shape = self._gamma(), float(self.shape)
        if gamma >= 1.0:  # mean 1: exactly one run
            yield 1.0
            while True:
                yield 0.0
        if shape == 0.0:  # logarithmic: (1 - gamma)^k / (k log(1 / gamma))
            p = (1 - gamma) / math.log(1 / gamma)
        else:  # (1 - gamma)^k / (gamma^-shape - 1) * prod_{l<k} (l + shape) / (l + 1), at k = 1
            p = (1 - gamma) * shape / (gamma ** -shape - 1)
        k = 1
        while True:
            yield p
            p *= (1 - gamma) * (k + shape) / (k + 1)  # P[K = k + 1] / P[K = k]
            k += 1

    def run_probabilities(self, up_to: int) -> list[float]:
        """P[K = k] for k = 1..up_to of the number of runs K."""
        return list(itertools.islice(self._pmf(), int(up_to)))

    def draw_runs(self, uniform: float) -> int:
        """The number of runs K for a uniform draw in [0, 1) (inverse CDF of `run_probabilities`)."""
        if not 0.0 <= uniform < 1.0:
            raise ValueError(f"uniform must be in [0, 1), got {uniform}")
        cdf = 0.0
        for k, p in enumerate(self._pmf(), start=1):
            cdf += p
            if cdf > uniform or p == 0.0:
                return k
        raise AssertionError("unreachable")  # pragma: no cover

    def released_epsilon(self, mech: Mechanism, noise_multiplier: float, delta: float,
                         extra_events: Iterable[dp_accounting.DpEvent] = (),
                         discretization: float | None = None) -> float:
        """The released model's epsilon when every run is `mech` at sigma (the plan's prediction)."""
        if not noise_multiplier > 0:
            return math.inf
        runs = [mech.dp_event(noise_multiplier)] * (1 if self.mode == "random_stopping" else self.candidates)
        return self.epsilon(self.released_event(runs, extra_events), delta, discretization)
