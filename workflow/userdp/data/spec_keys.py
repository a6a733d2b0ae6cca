"""Per-source validation of a dataset spec's keys.

The JSON schema lists every dataset key any source understands; which of them
a given source reads is only known to its loader. Each loader calls
`check_keys` so that a key meant for another source (e.g. `hub_name` on a
`local` dataset) is an error naming `datasets.<name>.<key>` instead of being
silently ignored.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import ConfigError

# Keys read by later stages (split, cleaning, public part) for every source.
COMMON_KEYS: frozenset[str] = frozenset(
    {"source", "split", "min_examples_per_user", "max_examples", "public"}
)


def check_keys(name: str, spec: dict, source_keys: Iterable[str]) -> None:
    """Raise ConfigError if `spec` has keys neither common nor in `source_keys`."""
    allowed = COMMON_KEYS | set(source_keys)
    unknown = sorted(set(spec) - allowed)
    if unknown:
        keys = ", ".join(f"datasets.{name}.{k}" for k in unknown)
        raise ConfigError(
            f"{keys}: not a key of source {spec.get('source')!r}; allowed keys for this source: "
            f"{sorted(allowed)}. See config/README.md, section 'datasets: sources'."
        )


def max_examples(name: str, spec: dict) -> int | None:
    """The optional `max_examples` cap, checked (None = read everything)."""
    value: Any = spec.get("max_examples")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"datasets.{name}.max_examples is {value!r}; it must be an integer >= 1 or null.")
    return int(value)


def check_nested_keys(name: str, key: str, value: dict, allowed: Iterable[str], what: str) -> None:
    """Raise ConfigError if the mapping `datasets.<name>.<key>` has keys not in `allowed`.

    `what` says what the mapping is (e.g. "a public corpus") for the message.
    """
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        keys = ", ".join(f"datasets.{name}.{key}.{k}" for k in unknown)
        raise ConfigError(
            f"{keys}: not a key of {what}; allowed keys: {sorted(allowed)}. See config/README.md, "
            "section 'datasets: sources'."
        )
