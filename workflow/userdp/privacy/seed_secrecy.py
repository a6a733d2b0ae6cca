"""Where the mechanism's randomness comes from: secret (OS entropy) or derived from the config seed.

The Poisson samples and the Gaussian noise of every run, and the Laplace
noise of the DP contribution statistics, are drawn from seeds. Derived from
`seed` in the config they make results reproducible, but anyone holding the
config can regenerate the samples and the noise and subtract it from a
released model: the (epsilon, delta) guarantee then does not hold against
them. Secret seeds are fresh OS entropy drawn when the job starts and never
written out (only a running job's checkpoint holds the generators' states).

`privacy.secret_seeds` decides per dataset (`secret_seeds`):

- null (the default): secret for every dataset whose source is not
  synthetic (userdp.data.sources, `SourceType.synthetic`), derived for
  synthetic ones (no real user's data, and the tests and the study compare
  reruns bit for bit);
- true / false: secret / derived for every dataset (false is the explicit
  opt-in to reproducible seeds on real data).

Artifacts that depend on the seeds carry `seeds_fields`: `seeds_mode`
("secret" or "derived") and `guarantee_caveat` (null, or the sentence that
says whom the guarantee does not cover).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..data.sources import SOURCES
from ..errors import ConfigError

KEY = "privacy.secret_seeds"
SECRET, DERIVED = "secret", "derived"
DERIVED_CAVEAT = (
    "seeds derived from the config seed: anyone holding the config can regenerate the Poisson samples and the "
    "noise, so the (epsilon, delta) guarantee does not hold against them"
)


def secret_seeds(config: Mapping[str, Any], dataset: str) -> bool:
    """Whether dataset `dataset`'s runs (and DP statistics) draw secret seeds (the resolved privacy.secret_seeds)."""
    value = (config.get("privacy") or {}).get("secret_seeds")
    if value is not None:
        return bool(value)
    spec = (config.get("datasets") or {}).get(dataset)
    if spec is None:
        raise ConfigError(f"{KEY} is null (per dataset), but dataset {dataset!r} is not in 'datasets' "
                          f"(defined: {sorted(config.get('datasets') or {})}).")
    kind = SOURCES.get(spec.get("source"))
    if kind is None:
        raise ConfigError(f"datasets.{dataset}.source is {spec.get('source')!r}; allowed values: {sorted(SOURCES)}.")
    return not kind.synthetic


def seeds_mode(secret: bool) -> str:
    return SECRET if secret else DERIVED


def seeds_fields(secret: bool) -> dict[str, Any]:
    """`seeds_mode` and `guarantee_caveat` of an artifact whose randomness is secret or derived."""
    return {"seeds_mode": seeds_mode(secret), "guarantee_caveat": None if secret else DERIVED_CAVEAT}


def combined_fields(*modes: str | None) -> dict[str, Any]:
    """The fields of an artifact depending on several draws (None: a draw that did not happen): derived if any is."""
    known = [m for m in modes if m is not None]
    if not known or any(m not in (SECRET, DERIVED) for m in known):
        raise ValueError(f"seeds modes {modes!r}: expected at least one of {SECRET!r} / {DERIVED!r}")
    return seeds_fields(all(m == SECRET for m in known))
