"""Helpers for workflow/rules/data.smk: which datasets have which rules and inputs.

Kept in the library (not in the .smk file) so the rules stay declarative and
these decisions are unit-testable.
"""

from __future__ import annotations

import re

from .. import layout
from ..errors import ConfigError
from .labels import has_labels
from .sources import has_public_part
from .tokenize import public_dataset_name


def names_regex(names: list[str]) -> str:
    """A wildcard regex matching exactly these dataset names (nothing if empty)."""
    return "|".join(re.escape(n) for n in names) or "(?!)"


def datasets_regex(config: dict) -> str:
    return names_regex(list(config["datasets"]))


def public_datasets(config: dict) -> list[str]:
    """Datasets with a public (pretraining) part, decided from the config alone."""
    return [n for n, s in config["datasets"].items() if has_public_part(s)]


def public_datasets_regex(config: dict) -> str:
    return names_regex(public_datasets(config))


def labelled_datasets(config: dict) -> list[str]:
    """Datasets whose users have group labels (userdp.data.labels.has_labels), decided from the config alone."""
    return [n for n, s in config["datasets"].items() if has_labels(s)]


def labelled_datasets_regex(config: dict) -> str:
    return names_regex(labelled_datasets(config))


def public_parquet_targets(config: dict) -> list[str]:
    return [layout.PUBLIC.format(dataset=n) for n in public_datasets(config)]


def tokenizer_inputs(config: dict) -> dict[str, str]:
    """Inputs of the tokenizer rule: the PUBLIC corpus only (never private text), or none for a named tokenizer."""
    if config["tokenizer"]["name"]:
        return {}
    name = public_dataset_name(config)
    if name is None:
        raise ConfigError(
            "tokenizer.name is null, so a BPE tokenizer is trained on public text, but no dataset has a public "
            "part; add a synthetic or fortunes dataset, give a dataset a public corpus (datasets.<name>.public), "
            "or set tokenizer.name."
        )
    return {"public": layout.PUBLIC.format(dataset=name)}


def unknown_datasets_regex(config: dict) -> str:
    """A wildcard regex matching any dataset name that is NOT in the config.

    The lookahead checks the text up to the next path separator, so
    `results/data/nope/...` matches and `results/data/synth/...` does not.
    """
    known = "|".join(re.escape(n) for n in config["datasets"])
    return rf"(?!(?:{known})/)[A-Za-z0-9_-]+" if known else r"[A-Za-z0-9_-]+"


def unknown_dataset_error(config: dict, dataset: str) -> None:
    """Raise the error for a target that names a dataset the config does not define."""
    raise ConfigError(
        f"dataset {dataset!r} is not defined under 'datasets' in the config "
        f"(defined: {sorted(config['datasets'])}); add it with --configfile (see config/README.md) "
        "or fix the target path."
    )
