"""File lists of the evaluation rules, and the wildcard patterns matching every cell folder."""

import re

from userdp import layout
from userdp.config import validate_config
from userdp.layout import fmt_num
from userdp.grid import iter_cells
from userdp.evaluation import targets
from userdp.plotting.registry import figure_targets


def cfg():
    return validate_config({
        "datasets": {"a": {"source": "synthetic"}, "b": {"source": "synthetic"}},
        "grid": {"datasets": ["a"], "epsilons": [0.5, 8], "budgets": [{"compute": 100, "steps": 5}],
                 "group_size_sweep": [2, 4]},
        "training": {"learning_rates": [1e-4, 0.001]},
    })


def test_evaluation_targets_cover_every_cell_and_figure():
    c = cfg()
    out = targets.evaluation_targets(c) + figure_targets(c, family="lm")
    cells = list(iter_cells(c))
    assert len(cells) == 2 * 3 + 2 * 2
    assert all(f"{cell.run_dir}/metrics.json" in out for cell in cells)
    assert "results/runs/a/pretrained/metrics.json" in out and "results/summary/a/metrics.parquet" in out
    assert "results/figures/lm_loss_vs_group_size_a.pdf" in out and "results/figures/training_curves_a.png" in out
    assert not any("/b/" in p or p.endswith("_b.png") for p in out)  # b is not a grid dataset
    assert len(out) == len(set(out))


def test_cell_and_lr_patterns_match_every_run_folder():
    c = cfg()
    cell_re = re.compile(layout.CELL_RE)
    lr_re = re.compile(layout.LR_RE)
    for cell in iter_cells(c):
        rel = cell.run_dir.split("results/runs/a/", 1)[1]
        assert cell_re.fullmatch(rel), rel
        assert not cell_re.fullmatch(rel + "/lr~0.001")
    for lr in c["training"]["learning_rates"]:
        assert lr_re.fullmatch(fmt_num(lr)), fmt_num(lr)
    assert targets.lr_run_files(c, "a", "X", "eval.json") == [
        "results/runs/a/X/lr~0.0001/eval.json", "results/runs/a/X/lr~0.001/eval.json"]


def test_pretrained_model_files_only_for_the_tiny_model():
    c = cfg()
    assert targets.pretrained_model_files(c) == ["results/model/pretrained/config.json",
                                                 "results/model/pretrained/model.safetensors"]
    c["model"]["name"] = "gpt2"
    assert targets.pretrained_model_files(c) == []
