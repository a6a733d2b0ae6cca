"""The config keys a job reads that change no result, so they are no rerun trigger.

Snakemake reruns a job whose params changed since it ran (the `params` rerun trigger), and that is right for
every key that changes the job's result: those are the rule's params, shown in the rule. Some keys a job reads
change no result: how many rows a read holds (tokenizer.batch_rows), the micro-batch width and checkpoint
interval of training, the evaluation batch size, ... (the lists are next to the rules' param helpers:
userdp.training.targets, userdp.evaluation.targets). A job's script reads those from the validated config that
Snakemake hands every script (`snakemake.config`), through `untracked`, so they never enter a params record.
tests/test_rerun_triggers.py checks that changing them reruns nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def untracked(config: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """The config keys `keys` (dotted: "training.physical_batch_size"), nested as in the config, copied.

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
    return out


def _missing(key: str) -> Any:
    raise KeyError(f"config key {key} is missing; validate the config (userdp.config.validate_config) first")
