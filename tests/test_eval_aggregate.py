"""Summary table: one row per cell, plan/ledger/metrics flattened, CSV and Parquet agree."""

import math

import pandas as pd
import pytest

from eval_builders import plan_record
from userdp.config import validate_config
from userdp.layout import fmt_num, iter_cells
from userdp.evaluation.aggregate import build_summary, flatten, summary_frame, write_summary
from userdp.evaluation.targets import summary_inputs
from userdp.io import write_json


def test_flatten_nests_with_dots_and_restores_infinities():
    out = flatten({"a": 1, "b": {"c": 2, "d": {"e": "x"}}, "l": [1, 2], "eps": "inf", "empty": {}}, "plan_")
    assert out == {"plan_a": 1, "plan_b.c": 2, "plan_b.d.e": "x", "plan_l": "[1, 2]", "plan_eps": math.inf,
                   "plan_empty": "{}"}


def small_config():
    cfg = {
        "datasets": {"toy": {"source": "synthetic"}},
        "grid": {"epsilons": [1, 4], "budgets": [{"compute": 100, "steps": 5}], "seeds": [0],
                 "group_size_sweep": [2]},
        "training": {"learning_rates": [0.001, 0.01]},
    }
    return validate_config(cfg)


def build_cells(root, cfg):
    for i, cell in enumerate(iter_cells(cfg)):
        g = cell.group_size or (4 if cell.method == "els" else 8)
        write_json(root / cell.plan_path, plan_record(cell.method, cell.epsilon, group_size=g,
                                                      group_size_rule="sweep" if cell.group_size else "median"))
        run = root / cell.run_dir
        write_json(run / "ledger.json", {"method": cell.method, "steps_completed": 5,
                                         "versions": {"torch": "2.13.0"}, "epsilon": cell.epsilon})
        write_json(run / "metrics.json", {"test_loss": 3.0 + i, "validation_loss": 3.1 + i, "learning_rate": 0.01,
                                          "learning_rate_sweep": [{"learning_rate": 0.01, "validation_loss": 3.1}]})
        pd.DataFrame({"step": range(1, 6), "loss": [5, 4, 3, 2, 1.0]}).to_parquet(run / "train_log.parquet")


def _inputs(root, cfg):
    """Rule aggregate's inputs for dataset toy, below `root`."""
    return {k: [str(root / p) for p in paths] for k, paths in summary_inputs(cfg, "toy").items()}


def test_build_summary_one_row_per_cell(tmp_path):
    cfg = small_config()
    build_cells(tmp_path, cfg)
    summary, curves = build_summary(cfg, _inputs(tmp_path, cfg))
    cells = list(iter_cells(cfg))
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


def test_missing_cell_file_names_it(tmp_path):
    cfg = small_config()
    from userdp.errors import DataError

    with pytest.raises(DataError, match="plan"):
        build_summary(cfg, _inputs(tmp_path, cfg))
