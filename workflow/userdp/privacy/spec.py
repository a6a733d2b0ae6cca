"""The run specification: a typed, frozen, serialisable record of one calibrated run (the plan artifact).

The planner (`planner.plan_cell`) decides a cell's mechanism and calibrates
its noise; training, the ledger, learning-rate selection and evaluation then
read fields of a `RunSpec`, never keys of a dict. The plan JSON
(`results/plans/.../plan.json`, docs/artifacts.md "Plans") is `RunSpec.to_record()`,
and `RunSpec.load(path)` reads one back and validates it: a missing or
mistyped field, an unknown method, a clip norm missing under noise, or a
`dp_event` that is not the event of the recorded mechanism (an edited
sampling rate, say) is a DataError naming the file and the field.

As in jax_privacy's execution plans and dp-accounting's events-as-data, the
spec holds the mechanism (`mechanism`: method, sampling rate q, steps T,
contribution bound G), its noise multiplier and clipping, the divisor policy
(`divisor_policy`: q N on the pool, or the plan's public expected batch when
the sizes come from the DP contribution statistics), the learning-rate
selection the calibration assumed (`selection`) and everything the planner
recorded for the report (rules, sizes, warnings).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar, Mapping

from ..errors import DataError, PrivacyError, UserError
from . import adaptive as adaptive_lib
from . import banded as banded_lib
from . import mechanism as mechanism_lib
from .selection import Selection

#: The plan's `planning_sizes` when N_G and mbar_G come from the DP contribution statistics.
PRIVATE_SIZES = "DP histogram"
#: The plan's one machine-dependent field: the calibration's wall time (calibration[CALIBRATION_TIMING]).
CALIBRATION_TIMING = "seconds"
#: Clipping modes: per-unit flat clipping min(1, C / ||g||) g, normalisation C g / ||g||, or flat clipping whose
#: C follows a quantile of the units' norms (privacy.adaptive: its record is the plan's `adaptive_clipping`).
CLIPPING_MODES = ("flat", "normalized", adaptive_lib.ADAPTIVE)

_FLOAT, _INT, _STR, _MAP, _LIST = "float", "int", "str", "mapping", "list"
_TYPES = {_INT: int, _STR: str, _MAP: Mapping, _LIST: list}  # the kinds checked by their type (bool is no int)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One calibrated run of DP-SGD (ELS or ULS; ULS also as banded DP-FTRL): what the planner decided and training
    must execute.

    Fields are the plan's (docs/artifacts.md, "Plans"), in its order. Required: the mechanism
    (method, sampling_rate, steps, group_size), its noise (noise_multiplier, clip_norm, clipping),
    the target (epsilon, delta) and the expected batch. The rest describe how the plan was made.
    """

    dataset: str
    method: str
    epsilon: float
    delta: float
    delta_rule: str | None = None
    group_size: int = 1
    group_size_rule: str | None = None
    sampling_rate: float = 0.0
    steps: int = 0
    expected_batch: float = 0.0
    expected_batch_unit: str | None = None
    noise_multiplier: float = 0.0
    epsilon_achieved: float | None = None
    compute_budget: int | None = None
    expected_compute: float | None = None
    accountant: str | None = None
    clip_norm: float | None = None
    clipping: str | None = None
    n_train_users: int | None = None
    n_train_examples: int | None = None
    n_train_examples_bounded: float | None = None
    mean_bounded_contribution: float | None = None
    planning_sizes: str | None = None
    calibration: Mapping[str, Any] | None = None
    contribution_statistics: str | None = None
    library_versions: Mapping[str, Any] | None = None
    dp_event: Mapping[str, Any] | None = None
    selection: Selection | None = None
    epsilon_target_of: str | None = None
    epsilon_per_run: float | None = None
    delta_warning: str | None = None
    group_size_note: str | None = None
    contribution_stats: Mapping[str, Any] | None = None
    group_size_candidates: list | None = None
    group_size_reference_epsilon: float | None = None
    median_train: float | None = None
    contribution_counts: str | None = None
    adaptive_clipping: Mapping[str, Any] | None = None
    correlated_noise: Mapping[str, Any] | None = None

    #: Fields every plan file must have (the rest default to None: not recorded). Only clip_norm and clipping
    #: may be null (the non-private reference). A spec built in code gets its dp_event computed.
    REQUIRED: ClassVar[tuple[str, ...]] = ("dataset", "method", "epsilon", "delta", "group_size", "sampling_rate",
                                           "steps", "expected_batch", "noise_multiplier", "clip_norm", "clipping",
                                           "dp_event")
    NULLABLE: ClassVar[tuple[str, ...]] = ("clip_norm", "clipping")
    #: Left out of the record when None (the planner writes them only when they apply).
    OPTIONAL_IN_RECORD: ClassVar[tuple[str, ...]] = ("contribution_stats", "group_size_candidates",
                                                     "group_size_reference_epsilon", "contribution_counts",
                                                     "adaptive_clipping", "correlated_noise")
    _KINDS: ClassVar[dict[str, str]] = {
        "dataset": _STR, "method": _STR, "epsilon": _FLOAT, "delta": _FLOAT, "delta_rule": _STR,
        "group_size": _INT, "group_size_rule": _STR, "sampling_rate": _FLOAT, "steps": _INT,
        "expected_batch": _FLOAT, "expected_batch_unit": _STR, "noise_multiplier": _FLOAT,
        "epsilon_achieved": _FLOAT, "compute_budget": _INT, "expected_compute": _FLOAT, "accountant": _STR,
        "clip_norm": _FLOAT, "clipping": _STR, "n_train_users": _INT, "n_train_examples": _INT,
        "n_train_examples_bounded": _FLOAT, "mean_bounded_contribution": _FLOAT, "planning_sizes": _STR,
        "calibration": _MAP, "contribution_statistics": _STR, "library_versions": _MAP, "dp_event": _MAP,
        "selection": _MAP, "epsilon_target_of": _STR, "epsilon_per_run": _FLOAT, "delta_warning": _STR,
        "group_size_note": _STR, "contribution_stats": _MAP, "group_size_candidates": _LIST,
        "group_size_reference_epsilon": _FLOAT, "median_train": _FLOAT, "contribution_counts": _STR,
        "adaptive_clipping": _MAP, "correlated_noise": _MAP,
    }

    def __post_init__(self) -> None:
        """Check the mechanism's fields (PrivacyError; `from_record` turns it into a DataError naming the file)."""
        nulls = [k for k in self.REQUIRED if k not in self.NULLABLE and k != "dp_event" and getattr(self, k) is None]
        if nulls:
            raise PrivacyError(f"plan field(s) {nulls} are null; each needs a value.")
        if self.method not in mechanism_lib.METHODS:
            raise PrivacyError(f"method is {self.method!r}; allowed: {', '.join(mechanism_lib.METHODS)}.")
        if not (0 < self.sampling_rate <= 1):
            raise PrivacyError(f"sampling_rate is {self.sampling_rate}; it must be in (0, 1].")
        if self.steps < 1 or self.group_size < 1:
            raise PrivacyError(f"steps ({self.steps}) and group_size ({self.group_size}) must be >= 1.")
        if not self.epsilon > 0:
            raise PrivacyError(f"epsilon is {self.epsilon}; it must be > 0 (inf: the non-private reference).")
        if not (0 < self.delta < 1):
            raise PrivacyError(f"delta is {self.delta}; it must be in (0, 1).")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise PrivacyError(f"noise_multiplier is {self.noise_multiplier}; it must be finite and >= 0.")
        if self.clip_norm is not None and not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise PrivacyError(f"clip_norm is {self.clip_norm}; it must be a finite number > 0, or null.")
        if self.noise_multiplier > 0 and self.clip_norm is None:
            raise PrivacyError(f"noise_multiplier is {self.noise_multiplier} but clip_norm is null: noise without "
                               "clipping bounds nothing.")
        if self.clipping is not None and self.clipping not in CLIPPING_MODES:
            raise PrivacyError(f"clipping is {self.clipping!r}; allowed: {', '.join(CLIPPING_MODES)} or null.")
        if (self.clipping == adaptive_lib.ADAPTIVE) != (self.adaptive_clipping is not None):
            raise PrivacyError(f"clipping is {self.clipping!r} with adaptive_clipping "
                               f"{'absent' if self.adaptive_clipping is None else 'present'}: adaptive clipping's "
                               "settings are recorded exactly when clipping is 'adaptive'.")
        if self.adaptive_clipping is not None:
            adaptive_lib.AdaptiveClipping.from_record(self.adaptive_clipping)
        if self.correlated_noise is not None:
            banded_lib.CorrelatedNoise.from_record(self.correlated_noise)
            if self.method != "uls" or self.noise_multiplier == 0:
                raise PrivacyError(f"correlated_noise is recorded for a {self.method} plan with noise_multiplier "
                                   f"{self.noise_multiplier}: banded DP-FTRL runs only in private ULS plans.")
        if not self.expected_batch >= 0:
            raise PrivacyError(f"expected_batch is {self.expected_batch}; it must be >= 0.")
        if math.isinf(self.epsilon) != (self.noise_multiplier == 0):
            raise PrivacyError(f"epsilon is {self.epsilon} with noise_multiplier {self.noise_multiplier}: a private "
                               "target needs noise and only the non-private reference (epsilon inf) runs without.")
        if self.planning_sizes is not None and (self.contribution_stats is not None) != self.sizes_from_release:
            raise PrivacyError(f"planning_sizes is {self.planning_sizes!r} but contribution_stats is "
                               f"{'absent' if self.contribution_stats is None else 'present'}: sizes come from the "
                               "DP contribution statistics exactly when their release is recorded.")
        expected = mechanism_lib.event_to_json(self.event)
        if self.dp_event is None:
            object.__setattr__(self, "dp_event", expected)
        elif not _same(self.dp_event, expected):
            raise PrivacyError("dp_event is not the event of the recorded mechanism (method, sampling_rate, "
                               "steps, group_size, noise_multiplier): the plan was edited after calibration.")

    # ------------------------------------------------------------------ derived views

    @property
    def mechanism(self) -> mechanism_lib.Mechanism:
        """The sampling mechanism (method, q, T, G) as the typed object of `privacy.mechanism`."""
        return mechanism_lib.from_record(vars(self))

    @property
    def event(self) -> Any:
        """The dp-accounting event of the T planned steps at this noise multiplier."""
        return self.mechanism.dp_event(self.noise_multiplier)

    def event_of_steps(self, steps: int) -> Any:
        """The event of `steps` steps of this mechanism (what a run that completed `steps` released)."""
        return self.mechanism.dp_event(self.noise_multiplier, int(steps))

    @property
    def private(self) -> bool:
        """Whether the run adds noise (False: the non-private reference, no guarantee)."""
        return self.noise_multiplier > 0

    @property
    def normalized(self) -> bool:
        """Normalised clipping C g / ||g|| instead of flat clipping."""
        return self.clipping == "normalized"

    @property
    def adaptive(self) -> adaptive_lib.AdaptiveClipping | None:
        """Adaptive clipping's settings (the clip norm is then C_0), None for a fixed clip norm."""
        if self.adaptive_clipping is None:
            return None
        return adaptive_lib.AdaptiveClipping.from_record(self.adaptive_clipping)

    @property
    def banded(self) -> banded_lib.CorrelatedNoise | None:
        """Banded DP-FTRL's strategy (userdp.privacy.banded), None for DP-SGD's independent noise."""
        if self.correlated_noise is None:
            return None
        return banded_lib.CorrelatedNoise.from_record(self.correlated_noise)

    @property
    def sizes_from_release(self) -> bool:
        """Whether N_G and mbar_G are the DP release's estimates: training then divides by the plan's public
        expected batch (not q * N on the pool) and writes no exact pool size (docs/privacy.md)."""
        return self.planning_sizes == PRIVATE_SIZES

    @property
    def divisor_policy(self) -> str:
        """What the noisy sum is divided by: "planned" (the plan's expected batch) or "pool" (q * N)."""
        return "planned" if self.sizes_from_release else "pool"

    @property
    def selection_policy(self) -> Selection:
        """How the cell's learning-rate runs become the released model (plans without a record: one run)."""
        return self.selection if self.selection is not None else Selection.from_record(None)

    @property
    def epsilon_of_one_run(self) -> float | None:
        """One learning-rate run's own epsilon (the plan's epsilon_per_run, else epsilon_achieved)."""
        return self.epsilon_per_run if self.epsilon_per_run is not None else self.epsilon_achieved

    def replace(self, **changes: Any) -> "RunSpec":
        """A copy with `changes` (validated again); its dp_event is recomputed unless `changes` gives one."""
        changes.setdefault("dp_event", None)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ serialisation

    def to_record(self) -> dict[str, Any]:
        """The plan JSON's fields (infinite floats stay floats; io.write_json writes them as "inf")."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OPTIONAL_IN_RECORD:
                continue
            if isinstance(value, Selection):
                value = value.record()
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    def without_timing(self) -> dict[str, Any]:
        """The record without the calibration's wall time: what a run's outputs depend on (finished-run key)."""
        out = self.to_record()
        if isinstance(out.get("calibration"), dict):
            out["calibration"] = {k: v for k, v in out["calibration"].items() if k != CALIBRATION_TIMING}
        return out

    @classmethod
    def from_record(cls, record: Any, where: str = "plan") -> "RunSpec":
        """A spec from a plan record (JSON data); DataError naming `where` and the field when it is damaged."""
        if isinstance(record, RunSpec):
            return record
        fix = "rebuild it: delete the plan file and rerun snakemake (rule plan), or plan again with userdp.plan"
        if not isinstance(record, Mapping):
            raise DataError(f"{where}: a plan must be a JSON object, not {type(record).__name__}; {fix}.")
        unknown = sorted(set(record) - set(cls._KINDS))
        if unknown:
            raise DataError(f"{where}: unknown plan field(s) {unknown}; {fix}.")
        missing = [k for k in cls.REQUIRED if k not in record]
        if missing:
            raise DataError(f"{where}: plan field(s) {missing} missing; {fix}.")
        values = {k: _typed(k, v, cls._KINDS[k], where, fix) for k, v in record.items()}
        if "selection" in values and values["selection"] is not None:
            try:
                values["selection"] = Selection.from_record(values["selection"])
            except (KeyError, TypeError, ValueError, UserError) as exc:
                raise DataError(f"{where}: plan field 'selection' is damaged ({exc}); {fix}.") from None
        try:
            return cls(**values)
        except PrivacyError as exc:
            raise DataError(f"{where}: {exc} {fix[0].upper() + fix[1:]}.") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunSpec":
        """Read and validate a plan JSON file."""
        from ..io import read_json

        return cls.from_record(read_json(path), str(path))

    def write(self, path: str | os.PathLike) -> None:
        """Write the plan JSON atomically."""
        from ..io import write_json

        write_json(path, self.to_record())


def _same(a: Any, b: Any, rel: float = 1e-9) -> bool:
    """Two event records equal up to float rounding (another scipy may round the mixture's weights otherwise)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=rel,
                                                                                            abs_tol=1e-300)
    return a == b


def _typed(key: str, value: Any, kind: str, where: str, fix: str) -> Any:
    """`value` of plan field `key` checked against `kind`; None stays None. Numbers keep their JSON type (the
    record round-trips unchanged), except infinities, which io.write_json writes as "inf" and come back as floats."""
    if value is None:
        return None
    bad = DataError(f"{where}: plan field {key!r} is {value!r}, not a {kind}; {fix}.")
    if kind == _FLOAT:
        if isinstance(value, str) and value in ("inf", "-inf"):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise bad
        return value
    if (kind == _INT and isinstance(value, bool)) or not isinstance(value, _TYPES[kind]):
        raise bad
    return value
