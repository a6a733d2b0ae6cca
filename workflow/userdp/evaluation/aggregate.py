"""The per-dataset summary: one row per grid cell, plan, ledger and metrics flattened.

Column names:
- identification: dataset, method, epsilon (inf for the non-private runs),
  budget (K), steps (T), seed, group_size (G actually used), is_group_sweep,
  run_dir; in the options' summary (options.parquet, rule aggregate_options)
  first the cell's `option` (a name of grid.options);
- metrics.json fields as they are (test_loss, ..., learning_rate); the
  learning-rate table `learning_rate_sweep` as JSON text;
- every plan field prefixed `plan_`, every ledger field prefixed `ledger_`;
  nested objects are flattened with dots (`ledger_versions.torch`) and lists
  become JSON text, so the table also fits in a CSV; the dp-accounting
  events (`plan_dp_event`, `ledger_dp_event`) are one JSON-text column each;
- `ledger_epsilon` is the released model's guarantee (learning-rate
  selection included), next to `ledger_epsilon_one_run` and
  `ledger_epsilon_meaning` (privacy.selection); `epsilon` is the grid target;
- `seeds_mode` ("secret" / "derived") and `guarantee_caveat` (null, or the
  sentence saying that anyone holding the config can regenerate the noise,
  so the guarantee does not hold against them), from the ledger
  (userdp.privacy.seed_secrecy);
- from the chosen run's train log: train_final_loss (mean training loss over
  the last 10% of logged steps; NaN unless the log has the batch loss, i.e.
  training.debug_step_log was on) and train_steps_logged.

A second table, train_curves.parquet, holds each cell's per-step training
curve (chosen learning rate): the batch `loss` (NaN without
training.debug_step_log) and `update_signal_norm` (inside the guarantee:
training.step_log), for the training-curve figure, so plotting never reads
run folders.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from ..errors import DataError
from ..io import atomic_path, clean_floats, read_frame, read_json, write_parquet
from ..grid import Cell, cell_of_dir
from ..privacy import seed_secrecy
from ..privacy.spec import RunSpec

log = logging.getLogger(__name__)

#: Rule aggregate's named inputs: one file per cell in each list, the cells in the same order.
SUMMARY_INPUTS = ("plans", "metrics", "ledgers", "train_logs")
ID_COLUMNS = ["dataset", "method", "epsilon", "budget", "steps", "seed", "group_size", "is_group_sweep", "run_dir"]
CURVE_VALUES = ["loss", "update_signal_norm"]  # per step; a column the log lacks is NaN
CURVE_COLUMNS = ["dataset", "method", "epsilon", "budget", "seed", "group_size", "is_group_sweep", "learning_rate",
                 "step", *CURVE_VALUES]
SEEDS_COLUMNS = ["seeds_mode", "guarantee_caveat"]
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _events_as_text(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with its dp-accounting event (`dp_event`) as one JSON-text value instead of nested columns."""
    out = dict(record)
    if isinstance(out.get("dp_event"), Mapping):
        out["dp_event"] = json.dumps(out["dp_event"], sort_keys=True)
    return out


def flatten(obj: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Flatten nested mappings to `prefix + a.b.c` keys; lists become JSON text."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + sep, sep))
        elif isinstance(v, (list, tuple, Mapping)):
            out[key] = json.dumps(v)
        else:  # write_json stores non-finite floats as strings; give them back as floats
            out[key] = _NONFINITE.get(v, v) if isinstance(v, str) else v
    return out


def train_log_stats(train_log: pd.DataFrame) -> dict[str, Any]:
    """Final training loss (mean over the last 10% of logged steps; NaN without the loss column) and steps logged."""
    if train_log.empty or "loss" not in train_log:
        return {"train_final_loss": math.nan, "train_steps_logged": int(len(train_log))}
    tail = max(1, len(train_log) // 10)
    ordered = train_log.sort_values("step") if "step" in train_log else train_log
    return {
        "train_final_loss": float(ordered["loss"].iloc[-tail:].mean()),
        "train_steps_logged": int(len(train_log)),
    }


def seeds_columns(ledger: Mapping) -> dict[str, Any]:
    """`seeds_mode` and `guarantee_caveat` of a cell, from its ledger (older ledgers: from `seeds.secret`)."""
    if ledger.get("seeds_mode") is not None:
        return {k: ledger.get(k) for k in SEEDS_COLUMNS}
    return seed_secrecy.seeds_fields(bool((ledger.get("seeds") or {}).get("secret")))


def cell_row(cell: Cell, plan: RunSpec, ledger: Mapping, metrics: Mapping, train_log: pd.DataFrame | None) -> dict:
    """One summary row for a cell (its plan's fields as plan_* columns, as the plan JSON writes them)."""
    g = cell.group_size if cell.group_size else plan.group_size
    row: dict[str, Any] = {
        "dataset": cell.dataset,
        "method": cell.method,
        "epsilon": float(cell.epsilon),
        "budget": int(cell.compute),
        "steps": int(cell.steps),
        "seed": int(cell.seed),
        "group_size": None if g is None else int(g),
        "is_group_sweep": cell.group_size is not None,
        "run_dir": cell.run_dir,
    }
    if cell.option:  # a cell of grid.options (its own summary: options.parquet)
        row["option"] = cell.option
    row.update(flatten(metrics))
    row.update(seeds_columns(ledger))
    row.update(flatten(_events_as_text(clean_floats(plan.to_record())), "plan_"))
    row.update(flatten(_events_as_text({k: v for k, v in ledger.items() if k not in SEEDS_COLUMNS}), "ledger_"))
    if train_log is not None:
        row.update(train_log_stats(train_log))
    return row


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Make every column Parquet-friendly: mixed-type object columns become text."""
    for col in df.columns:
        if df[col].dtype != object:
            continue
        kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
        if len(kinds) > 1 and not kinds <= {int, float}:
            df[col] = [None if v is None else str(v) for v in df[col]]
        elif kinds <= {int, float} and kinds:
            df[col] = pd.to_numeric(df[col])
    return df


def summary_frame(rows: Iterable[dict]) -> pd.DataFrame:
    """Rows -> DataFrame with the identification columns first, sorted by cell."""
    df = pd.DataFrame(list(rows))
    if df.empty:
        return pd.DataFrame(columns=ID_COLUMNS)
    ids = (["option"] if "option" in df.columns else []) + ID_COLUMNS
    df = df[ids + [c for c in df.columns if c not in ids]]
    df = df.sort_values(ids[:-len(ID_COLUMNS)] + ["is_group_sweep", "method", "epsilon", "budget", "group_size",
                                                   "seed"], kind="stable")
    return _normalise(df.reset_index(drop=True))


def _read_json(path: str | os.PathLike, what: str) -> dict:
    if not Path(path).exists():
        raise DataError(f"{what} {path} does not exist; rerun the rule that writes it.")
    return read_json(path)


def build_summary(config: Mapping, inputs: Mapping[str, Sequence[str | os.PathLike]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Summary rows and training curves of the cells whose files `inputs` lists.

    `inputs` maps each of SUMMARY_INPUTS to one path per cell (rule
    aggregate's input). Each cell is identified by the folder of its
    metrics.json (userdp.grid.cell_of_dir; its steps from the config's
    grid.budgets). Curves come in input order.
    """
    missing = [k for k in SUMMARY_INPUTS if k not in inputs]
    if missing:
        raise ValueError(f"summary inputs lack {missing}; expected {list(SUMMARY_INPUTS)}")
    files = [list(inputs[k]) for k in SUMMARY_INPUTS]
    if len({len(f) for f in files}) != 1:
        raise ValueError(f"summary inputs differ in length: {dict(zip(SUMMARY_INPUTS, map(len, files)))}")
    rows, curves = [], []
    dataset = None
    for plan_path, metrics_path, ledger_path, log_path in zip(*files):
        cell = cell_of_dir(str(Path(metrics_path).parent), config)
        dataset = cell.dataset
        plan = RunSpec.load(plan_path)
        ledger = _read_json(ledger_path, "ledger")
        metrics = _read_json(metrics_path, "metrics")
        log_path = Path(log_path)
        train_log = read_frame(log_path) if log_path.exists() else None
        row = cell_row(cell, plan, ledger, metrics, train_log)
        rows.append(row)
        if train_log is not None and "step" in train_log.columns:
            c = train_log[["step"]].copy()
            for k in CURVE_VALUES:
                c[k] = train_log[k].astype(float) if k in train_log.columns else math.nan
            for k in CURVE_COLUMNS[: CURVE_COLUMNS.index("step")]:
                c[k] = row.get(k)
            curves.append(c[CURVE_COLUMNS])
    summary = summary_frame(rows)
    curve_df = pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(columns=CURVE_COLUMNS)
    log.info("%s: %d cells summarised, %d training-curve points", dataset or "(no cells)", len(summary), len(curve_df))
    return summary, curve_df


def write_csv(path: str | os.PathLike, df: pd.DataFrame) -> None:
    """Write a DataFrame as CSV, atomically."""
    with atomic_path(path, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)


def write_summary(summary: pd.DataFrame, curves: pd.DataFrame, parquet: str, csv: str, curves_path: str | None) -> None:
    """The summary as Parquet and CSV, and the curves unless `curves_path` is None."""
    write_parquet(parquet, summary)
    write_csv(csv, summary)
    if curves_path is not None:
        write_parquet(curves_path, curves)
