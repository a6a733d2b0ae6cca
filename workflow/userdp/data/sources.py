"""The registry of dataset sources: each source declared once, in `SOURCES`.

A declaration names the source (the `datasets.<name>.source` value), its
loader (imported only when a dataset of that source is opened, so reading
the registry imports no loader), the config keys its loader reads besides
the common ones (`spec_keys.COMMON_KEYS`), and whether it has a built-in
public (pretraining) part. Config validation (`userdp.config`), the loaders'
own key checks, `has_public_part` and `open_source` all read it; the
schema's `source` enum lists the same names (tests/test_registries.py).

Adding a source: write its loader module (a class taking
`(name, spec, data_dir, seed)` and implementing `base.Source`) and add one
`SourceType` below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .base import Source


def _never(spec: dict) -> bool:
    return False


def _always(spec: dict) -> bool:
    return True


def _synthetic_public(spec: dict) -> bool:
    # synthetic.public_examples: 0 turns the built-in public corpus off.
    return int((spec.get("synthetic") or {}).get("public_examples", 1)) > 0


@dataclass(frozen=True)
class SourceType:
    """One dataset source: its loader ("module.Class" in userdp.data), config keys and built-in public part.

    `public(spec)` says, from the config alone, whether the source yields
    public text without a `public` key (Snakemake must know this when it
    builds the DAG, before any data is read).
    """

    name: str
    loader: str
    keys: frozenset[str]
    public: Callable[[dict], bool] = _never

    def open(self, name: str, spec: dict, data_dir: Path, seed: int) -> "Source":
        """Build the loader of dataset `name` (without the `public`-key routing of open_source)."""
        module, _, attr = self.loader.rpartition(".")
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)(name, spec, data_dir, seed)


#: source name -> declaration, in the order of the schema's enum.
SOURCES: dict[str, SourceType] = {
    s.name: s
    for s in (
        SourceType("synthetic", "synthetic.SyntheticSource", frozenset({"synthetic"}), _synthetic_public),
        SourceType("stackoverflow", "stackoverflow.StackOverflowSource",
                   frozenset({"path", "url", "sha256", "splits", "include_title"})),
        SourceType("cc_news", "cc_news.CCNewsSource",
                   frozenset({"path", "hub_name", "hub_split", "streaming", "include_title"})),
        SourceType("local", "local.LocalSource", frozenset({"path", "format", "user_column", "text_column"})),
        SourceType("fortunes", "fortunes.FortunesSource", frozenset({"path"}), _always),
    )
}


def source_keys(source: str) -> frozenset[str]:
    """The dataset keys source `source` reads besides the common ones."""
    return SOURCES[source].keys


def has_public_part(spec: dict) -> bool:
    """Whether dataset `spec` yields public text (decided from the config alone).

    A non-null `public` key (a user-named corpus, userdp.data.public) gives
    every source a public part, and replaces the built-in one of synthetic
    and fortunes; without it only sources declared with one have it.
    """
    if spec.get("public") is not None:
        return True
    kind = SOURCES.get(spec.get("source"))
    return kind is not None and kind.public(spec)


def open_source(name: str, spec: dict, data_dir: str | Path = "data", seed: int = 0) -> "Source":
    """Build the Source for dataset `name` from its config spec (its loader: `SOURCES`).

    With a non-null `public` key the source's public part is that corpus
    (`userdp.data.public.with_public`), whatever the source.
    """
    from ..errors import ConfigError
    from .public import with_public  # lazy: the public-corpus readers import the loaders' base

    kind = spec.get("source")
    if kind not in SOURCES:
        raise ConfigError(
            f"datasets.{name}.source is {kind!r}; allowed values: {sorted(SOURCES)}."
        )
    source = SOURCES[kind].open(name, spec, Path(data_dir) / name, seed)
    return with_public(source, name, spec, Path(data_dir) / name)
