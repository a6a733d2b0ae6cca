"""File lists of the evaluation rules, and the wildcard patterns matching every cell folder."""

import re

from userdp import layout
from userdp.config import validate_config
from userdp.layout import fmt_num
from userdp.grid import iter_cells
from userdp.plotting.registry import figure_targets


def cfg():
    return validate_config({
        "datasets": {"a": {"source": "synthetic"}, "b": {"source": "synthetic"}},
        "grid": {"datasets": ["a"], "epsilons": [0.5, 8], "budgets": [{"compute": 100, "steps": 5}],
                 "group_size_sweep": [2, 4]},
        "training": {"learning_rates": [1e-4, 0.001]},
    })


def test_lm_figure_targets_cover_the_grid_datasets_only():
    out = figure_targets(cfg(), family="lm")
    assert "results/figures/lm_loss_vs_group_size_a.pdf" in out and "results/figures/training_curves_a.png" in out
    assert not any(p.endswith(("_b.png", "_b.pdf")) for p in out)  # b is not a grid dataset
    assert len(out) == len(set(out)) == 5 * 2


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


def test_evaluation_params_score_validation_users_only_where_runs_are_choices():
    """One definition of what changes an evaluation's metrics: rule finetune's `evaluation` param (validation
    users where the cell chooses among its two learning rates), rule evaluate_pretrained's (a choice of nothing:
    test users only) and rule random_stopping's (its runs are choices: both splits, the default, no key)."""
    from userdp.evaluation.targets import evaluation_params

    c = cfg()
    users = {"max_users": c["evaluation"]["max_users"], "seed": c["seed"]}
    assert evaluation_params(c) == evaluation_params(c, selects=True) == users
    assert evaluation_params(c, selects=False) == {**users, "splits": ["test"]}
    one_rate = validate_config({**c, "training": {**c["training"], "learning_rates": [0.001]}})
    assert evaluation_params(one_rate) == {**users, "splits": ["test"]}
    always = validate_config({**c, "evaluation": {**c["evaluation"], "validation": "always"}})
    assert evaluation_params(always, selects=False) == users
