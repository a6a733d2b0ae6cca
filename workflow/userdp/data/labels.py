"""Per-user group labels of a dataset (rule user_labels -> results/data/{dataset}/user_labels.parquet).

A label is a fact about a user that is constant over the user's examples and
names the user's group in the cost-of-privacy table
(userdp.evaluation.groups):

- kind "topic" (source `synthetic`): "rare" or "common", the user's main
  topic under `synthetic.topic_weights` (userdp.data.synthetic);
- kind "label" (source `local` with `datasets.<name>.group_column`): the
  column's value, checked constant per user (userdp.data.local).

Sources without labels (and local files without group_column) have no rule:
their users are grouped by contribution size only, which the groups job
computes from the held-out users' own evaluation counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa

from ..io import write_parquet

LABEL_COLUMNS = ("user_id", "kind", "label")


def has_labels(spec: Mapping[str, Any]) -> bool:
    """Whether a dataset spec gives its users labels (decided from the config alone)."""
    return spec.get("source") == "synthetic" or (spec.get("source") == "local" and bool(spec.get("group_column")))


def write_labels(source: Any, path: str | Path, batch_rows: int = 10_000) -> int:
    """Write `source.user_labels()` (user_id, kind, label) to `path`; the number of users labelled."""
    table = source.user_labels(batch_rows)
    if table is None:
        raise ValueError(f"dataset {source.name!r} has no user labels (userdp.data.labels.has_labels)")
    table = table.select(list(LABEL_COLUMNS)).cast(
        pa.schema([(c, pa.string()) for c in LABEL_COLUMNS]))
    write_parquet(path, table)
    return table.num_rows
