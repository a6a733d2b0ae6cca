"""Summary table: one row per cell, plan/ledger/metrics flattened, CSV and Parquet agree."""

import math
import re

import pandas as pd
import pytest

from userdp.evaluation.aggregate import build_summary, flatten, summary_frame, write_summary


def test_flatten_nests_with_dots_and_restores_infinities():
    out = flatten({"a": 1, "b": {"c": 2, "d": {"e": "x"}}, "l": [1, 2], "eps": "inf", "empty": {}}, "plan_")
    assert out == {"plan_a": 1, "plan_b.c": 2, "plan_b.d.e": "x", "plan_l": "[1, 2]", "plan_eps": math.inf,
                   "plan_empty": "{}"}


def test_build_summary_one_row_per_cell(aggregate_cells, tmp_path):
    cfg, cells = aggregate_cells.config, aggregate_cells.cells
    summary, curves = build_summary(cfg, aggregate_cells.inputs)
    assert len(summary) == len(cells) == 2 * 3 + 2  # (els, uls) x (1, 4, inf) + 2 sweep cells
    assert summary["is_group_sweep"].sum() == 2
    assert set(summary["epsilon"]) == {1.0, 4.0, math.inf}
    assert summary.loc[summary.is_group_sweep, "group_size"].tolist() == [2, 2]
    main = summary[~summary.is_group_sweep]
    assert set(main.loc[main.method == "els", "group_size"]) == {4}
    for col in ("plan_noise_multiplier", "plan_group_size_rule", "ledger_versions.torch", "ledger_epsilon",
                "plan_epsilon", "test_loss", "validation_loss", "learning_rate", "learning_rate_sweep",
                "dataset", "method", "budget", "seed", "train_final_loss"):
        assert col in summary.columns, col
    assert summary["ledger_epsilon"].dtype.kind == "f"  # "inf" strings from JSON came back as floats
    # the released model's guarantee is the ledger's `epsilon` column, once (no copy under another name)
    assert not {"epsilon_released", "epsilon_meaning"} & set(summary.columns)
    assert summary["train_final_loss"].iloc[0] == pytest.approx(1.0)
    assert len(curves) == 5 * len(cells)
    paths = [tmp_path / n for n in ("m.parquet", "m.csv", "c.parquet")]
    write_summary(summary, curves, *map(str, paths))
    back = pd.read_parquet(paths[0])
    csv = pd.read_csv(paths[1])
    assert len(back) == len(csv) == len(summary)
    assert list(csv.columns) == list(back.columns)
    assert sorted(csv["epsilon"].tolist()) == sorted(summary["epsilon"].tolist())


def test_mixed_type_columns_become_text():
    df = summary_frame([
        {"dataset": "d", "method": "els", "epsilon": 1.0, "budget": 1, "steps": 1, "seed": 0, "group_size": 2,
         "is_group_sweep": False, "run_dir": "x", "plan_rule": "median"},
        {"dataset": "d", "method": "uls", "epsilon": 1.0, "budget": 1, "steps": 1, "seed": 0, "group_size": 2,
         "is_group_sweep": False, "run_dir": "y", "plan_rule": 8},
    ])
    import pyarrow as pa

    pa.Table.from_pandas(df)  # would raise on a mixed str/int column
    assert df["plan_rule"].tolist() == ["median", "8"]


def test_missing_cell_file_names_it(aggregate_cells):
    from userdp.errors import DataError

    missing = aggregate_cells.cells[0].plan_path
    (aggregate_cells.root / missing).unlink()
    with pytest.raises(DataError, match=re.escape(missing)):
        build_summary(aggregate_cells.config, aggregate_cells.inputs)
