"""Rule params that reach the job but are no rerun trigger: the config keys a job reads that change no result.

A job's script builds its work from its rule's params, input, output, wildcards, threads and resources, never
from the whole config, so everything it reads is visible in its rule. Snakemake reruns a job whose params
changed since it ran (the `params` rerun trigger), and that is right for every key that changes the job's
result. Some keys a job reads change no result: how many rows a read holds (tokenizer.batch_rows), the
micro-batch width and checkpoint interval of training, the evaluation batch size, ... (the lists are next to
the rules' param helpers: userdp.training.settings, userdp.evaluation.targets). Those go into one param,
`untracked`, built here.

How it stays out of the rerun trigger: Snakemake records a param by its repr only when its value is a built-in
type (str, number, None, list, tuple, dict, set, ...); it skips a param of any other type, both when it records
a finished job and when it compares (snakemake.persistence, `_serialize_param_builtin`: "UNREPRESENTABLE").
`Untracked` is such a type: a read-only mapping, pickled to the script like every param. tests/test_rerun_triggers.py
checks that the installed Snakemake still skips it, and that changing these keys reruns nothing. (Snakemake
also leaves the params out of the job properties it writes as JSON into a cluster job script when one of them
is not JSON, as this one: nothing in this workflow reads them there.)

Other ways were weighed: `resources` (also no rerun trigger, but they are scheduled and summed as resources,
must be int or str, and a profile's set-resources would override them per rule), and a param function that
takes `threads` or `resources` (Snakemake also skips such "derived" params, but that reads as a dependency the
value does not have).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any


class Untracked(Mapping):
    """A rule param's value (a read-only mapping of config sections) that Snakemake does not record.

    The job reads it like the config it comes from: params.untracked["training"]["physical_batch_size"].
    """

    def __init__(self, sections: Mapping[str, Any] = (), **more: Any) -> None:
        self._sections = {**dict(sections), **more}

    def __getitem__(self, key: str) -> Any:
        return self._sections[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sections)

    def __len__(self) -> int:
        return len(self._sections)

    def __repr__(self) -> str:
        return f"Untracked({self._sections!r})"


def untracked(config: Mapping[str, Any], *keys: str) -> Untracked:
    """The config keys `keys` (dotted: "training.physical_batch_size"), nested as in the config, as `Untracked`.

    A key that is absent raises KeyError naming it (the Snakefile validates the config first, which fills
    every default).
    """
    out: dict[str, Any] = {}
    for key in keys:
        *parents, leaf = key.split(".")
        src, dst = config, out
        for p in parents:
            src = src[p] if p in src else _missing(key)
            dst = dst.setdefault(p, {})
        dst[leaf] = copy.deepcopy(src[leaf] if leaf in src else _missing(key))
    return Untracked(out)


def _missing(key: str) -> Any:
    raise KeyError(f"config key {key} is missing; validate the config (userdp.config.validate_config) first")
