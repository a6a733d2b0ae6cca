"""The findings job (rule findings): read the finished tables a study wrote and write its findings table."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from .. import grid, layout
from ..io import read_frame, read_json, write_json
from . import findings
from .aggregate import write_csv


def diversity_of(config: Mapping, dataset: str) -> float | None:
    """A dataset's within-user diversity level: the synthetic source's topic concentration alpha (None otherwise)."""
    spec = config["datasets"][dataset]
    if spec.get("source") != "synthetic":
        return None
    return float((spec.get("synthetic") or {}).get("alpha", 0.1))


def params(config: Mapping) -> dict:
    """Rule findings' params: what the job reads besides its input files. `settings` (the findings section),
    the grid's datasets (in the order of the summaries and pretrained inputs), each one's diversity level
    and where the G sweep runs (grid.group_sweep_point)."""
    datasets = grid.grid_datasets(config)
    return {"settings": config["findings"], "datasets": datasets,
            "audit_cells": [[c.dataset, c.method, layout.fmt_num(c.epsilon)] for c in grid.audit_cells(config)]
            if config["findings"]["audit"] else [],
            "diversities": {d: diversity_of(config, d) for d in datasets},
            "group_sweep_point": grid.group_sweep_point(config),
            # claims 11-14: the groups section (as rule groups reads it) and the seed of the bootstrap draws
            "groups": {k: v for k, v in config["groups"].items() if k != "per_user_points"}, "seed": config["seed"],
            # claim 15: each option of grid.options and its methods (the options tables are in the datasets'
            # order); only with options, so that configs without them rerun nothing
            **({"options": {o: grid.option_methods(config, o) for o in config["grid"]["options"]}}
               if config["grid"]["options"] else {})}


def audit_rows(params: Mapping, audit_results: Sequence[str], audit_scores: Sequence[str]) -> list:
    """Claim 9 from the audit's result and score files (in the order of params["audit_cells"]), or its
    not-measured row when the study leaves the audit out (findings.audit: false)."""
    if not params["settings"].get("audit"):
        return [findings.Finding(9, findings.AUDIT, findings.AUDIT_CLAIMS[9], None, None, None, ">", 0.0,
                                 findings.NOT_MEASURED, "", "", "audit_epsilon",
                                 "findings.audit is false: set it to true to run the audit (snakemake audit) "
                                 "for the findings")]
    cells = [tuple(c) for c in params["audit_cells"]]
    scores = {cell: read_frame(p) for cell, p in zip(cells, audit_scores)}
    return findings.audit_findings([read_json(p) for p in audit_results], scores)


def run(params: Mapping, summaries: Sequence[str], pretrained: Sequence[str], comparison: str,
        mean_estimation: str, out_json: str, out_csv: str, audit_results: Sequence[str] = (),
        audit_scores: Sequence[str] = (), users: Sequence[str] | None = None,
        options: Sequence[str] = ()) -> dict:
    """The findings table from the finished tables; `params` as `params(config)` gives them; `users`: each
    dataset's per-user table (claims 11-14; None leaves them out); `options`: each dataset's options table
    (claim 15, when params["options"] names any)."""
    datasets = list(params["datasets"])
    tables = {d: read_frame(p) for d, p in zip(datasets, summaries)}
    pre = {}
    for d, p in zip(datasets, pretrained):
        v = read_json(p).get("test_loss")
        pre[d] = float(v) if v is not None else math.nan
    spec = params["settings"]
    result = findings.build(
        tables, pre, dict(params["diversities"]), dict(params["group_sweep_point"]),
        read_frame(mean_estimation), read_frame(comparison),
        float(spec["loss_tolerance"]), float(spec["relative_tolerance"]), spec["name"],
        audit=audit_rows(params, audit_results, audit_scores),
        groups=None if users is None else ({d: read_frame(p) for d, p in zip(datasets, users)},
                                           params["groups"], int(params["seed"])),
        options=({d: read_frame(p) for d, p in zip(datasets, options)}, dict(params["options"]))
        if params.get("options") else None,
    )
    write_json(out_json, result)
    write_csv(out_csv, findings.table(result))
    return result
