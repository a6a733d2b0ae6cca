"""grid.options: side-by-side runs of the private cells with another mechanism or optimizer.

The config (validation, the merged config an option's cells read), the grid (which cells, their paths and
folders parsed back), what reaches the plan and fine-tuning jobs (params), the options summary, claim 15 of
the findings (the option against the grid's DP-SGD, with its Welch interval) and the loss-gap figure. The real
pipeline with options runs in tests/test_e2e_pipeline.py.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pandas as pd
import pytest

from userdp import grid, layout
from userdp.config import option_config, validate_config
from userdp.errors import ConfigError
from userdp.evaluation import findings
from userdp.privacy.targets import plan_privacy_params
from userdp.training.targets import finetune_params

OPTIONS = {
    "clip": {"privacy": {"clipping": "adaptive", "adaptive": {"quantile": 0.7}}},
    "bc": {"training": {"optimizer": "adam_bc"}},
    "ftrl": {"methods": ["uls"], "privacy": {"correlated_noise": {"bands": 4}}},
}


def _config(options=None, **grid_keys):
    return validate_config({
        "datasets": {"toy": {"source": "synthetic"}},
        "grid": {"epsilons": [1, 8], "budgets": [{"compute": 100, "steps": 5}, {"compute": 400, "steps": 5}],
                 "seeds": [0, 1], "group_size_sweep": [2], **grid_keys,
                 "options": copy.deepcopy(OPTIONS if options is None else options)},
    })


# ---------------------------------------------------------------- config


def test_no_options_by_default():
    c = validate_config({"datasets": {"toy": {"source": "synthetic"}}})
    assert c["grid"]["options"] == {} and list(grid.option_cells(c)) == []


def test_an_option_merges_over_the_base_key_by_key():
    c = _config()
    clip = option_config(c, "clip")
    assert clip["privacy"]["clipping"] == "adaptive"
    # privacy.adaptive merges: the option's quantile, the base's (default) other keys
    assert clip["privacy"]["adaptive"]["quantile"] == 0.7
    assert clip["privacy"]["adaptive"]["learning_rate"] == c["privacy"]["adaptive"]["learning_rate"]
    assert clip["training"] == c["training"] and clip["grid"]["options"] == {}
    assert option_config(c, "bc")["training"]["optimizer"] == "adam_bc"
    assert option_config(c, "ftrl")["privacy"]["correlated_noise"] == {"bands": 4}
    assert c["privacy"]["clipping"] == "flat" and c["privacy"]["correlated_noise"] is None  # the base untouched


@pytest.mark.parametrize("options, match", [
    ({"x": {"privacy": {"clipping": "adaptive", "adaptive": {"quantile": 2}}}},
     r"grid\.options\.x \(its keys merged over the config's\): config key 'privacy\.adaptive\.quantile'"),
    ({"same": {"training": {"optimizer": "adam"}}}, r"grid\.options\.same changes nothing in its ELS/ULS cells"),
    ({"ftrl": {"privacy": {"correlated_noise": {"bands": 4}}}},
     r"grid\.options\.ftrl changes nothing in its ELS cells.*`methods: \['uls'\]` only"),
    # adaptive's settings without adaptive clipping change no plan
    ({"q": {"privacy": {"adaptive": {"quantile": 0.7}}}}, r"grid\.options\.q changes nothing in its ELS/ULS"),
    ({"ftrl": {"privacy": {"correlated_noise": {"bands": 1}}}, "methods": ["uls"]}, r"grid\.options"),
    ({"m": {"methods": ["foo"], "training": {"optimizer": "sgd"}}}, r"grid\.options\.m\.methods"),
    ({"1a": {"training": {"optimizer": "sgd"}}}, r"'grid\.options'.*'1a' does not match"),
    ({"d": {"privacy": {"delta": 1e-6}}}, r"grid\.options\.d\.privacy.*'delta'.*allowed values"),
    ({"lr": {"training": {"learning_rates": [0.1]}}}, r"grid\.options\.lr\.training"),
    ({"empty": {}}, r"grid\.options\.empty"),
])
def test_bad_options_are_refused_naming_the_key(options, match):
    with pytest.raises(ConfigError, match=match):
        _config(options)


def test_an_option_is_judged_by_what_its_cells_read():
    """Allowed: an option that changes ELS cells through one key and ULS cells through another, and any option
    beside a base that already uses DP-FTRL (its ELS cells stay DP-SGD)."""
    both = _config({"x": {"privacy": {"correlated_noise": {"bands": 2}}, "training": {"optimizer": "adam_bc"}}})
    assert {c.method for c in grid.option_cells(both)} == {"els", "uls"}
    c = validate_config({"datasets": {"toy": {"source": "synthetic"}},
                         "privacy": {"correlated_noise": {"bands": 2}},
                         "grid": {"options": {"bc": {"training": {"optimizer": "adam_bc"}}}}})
    assert {x.method for x in grid.option_cells(c)} == {"els", "uls"}


def test_an_option_with_a_method_the_grid_does_not_run_is_refused():
    with pytest.raises(ConfigError, match=r"grid\.options\.bc\.methods names \['els'\].*grid\.methods \['uls'\]"):
        _config({"bc": {"methods": ["els"], "training": {"optimizer": "adam_bc"}}}, methods=["uls"])


# ---------------------------------------------------------------- grid and paths


def test_option_cells_copy_every_private_cell_of_their_methods():
    c = _config()
    cells = list(grid.option_cells(c))
    private = [x for x in grid.iter_cells(c) if math.isfinite(x.epsilon) and x.group_size is None]
    assert len(private) == 2 * 2 * 2 * 2  # methods x epsilons x budgets x seeds
    by_option = {o: [x for x in cells if x.option == o] for o in OPTIONS}
    strip = lambda x: (x.dataset, x.method, x.epsilon, x.compute, x.steps, x.seed)  # noqa: E731
    assert sorted(map(strip, by_option["clip"])) == sorted(map(strip, private))
    assert sorted(map(strip, by_option["bc"])) == sorted(map(strip, private))
    assert sorted(map(strip, by_option["ftrl"])) == sorted(strip(x) for x in private if x.method == "uls")
    assert all(math.isfinite(x.epsilon) and x.group_size is None for x in cells)
    # none of them is a grid cell: rule aggregate's summary stays the grid's
    assert not set(cells) & set(grid.iter_cells(c))


def test_option_cells_have_their_own_plan_and_folder_parsed_back():
    c = _config()
    cell = next(x for x in grid.option_cells(c) if x.option == "ftrl")
    assert cell.plan_path == "results/plan/toy/option~ftrl/method~uls/eps~1/budget~100.json"
    assert cell.run_dir == "results/runs/toy/option~ftrl/method~uls/eps~1/budget~100/seed~0"
    assert grid.cell_of_dir(cell.run_dir, c) == cell
    base = grid.Cell("toy", "uls", 1.0, 100, 5, 0)
    assert base.run_dir == "results/runs/toy/method~uls/eps~1/budget~100/seed~0"  # unchanged without an option
    assert grid.cell_of_dir(base.run_dir, c) == base
    # the {cell} wildcard of the evaluation rules takes option cells (all, and the private ones); not eps~inf
    assert re.fullmatch(layout.CELL_RE, cell.cell) and re.fullmatch(layout.PRIVATE_CELL_RE, cell.cell)
    assert not re.fullmatch(layout.NON_PRIVATE_CELL_RE, cell.cell)
    assert re.fullmatch(layout.template_regex(layout.OPTION_PLAN), cell.plan_path)
    assert not re.fullmatch(layout.template_regex(layout.PLAN), cell.plan_path)


def test_what_reaches_the_jobs_is_the_options_config():
    c = _config()
    base_plan = plan_privacy_params(c, "uls", "1")
    assert plan_privacy_params(option_config(c, "ftrl"), "uls", "1") == {**base_plan,
                                                                          "correlated_noise": {"bands": 4}}
    clip = plan_privacy_params(option_config(c, "clip"), "els", "8")
    assert clip["clipping"] == "adaptive" and clip["adaptive"]["quantile"] == 0.7
    assert plan_privacy_params(option_config(c, "bc"), "els", "1") == plan_privacy_params(c, "els", "1")
    assert finetune_params(option_config(c, "bc"), "toy")["training"]["optimizer"] == "adam_bc"
    assert finetune_params(option_config(c, "ftrl"), "toy") == finetune_params(c, "toy")


# ---------------------------------------------------------------- summary


def test_the_options_summary_names_each_cells_option(aggregate_cells):
    from eval_builders import plan_record
    from userdp.evaluation.aggregate import build_summary
    from userdp.io import write_json

    root = aggregate_cells.root
    c = copy.deepcopy(aggregate_cells.config)
    c["grid"]["options"] = {"bc": {"training": {"optimizer": "adam_bc"}}}
    validate_config(c)
    cells = list(grid.option_cells(c))
    assert cells and all(x.option == "bc" for x in cells)
    for cell in cells:
        write_json(root / cell.plan_path, plan_record(cell.method, cell.epsilon))
        run = root / cell.run_dir
        write_json(run / "ledger.json", {"method": cell.method, "epsilon": cell.epsilon})
        write_json(run / "metrics.json", {"test_loss": 2.5, "learning_rate": 0.01})
        pd.DataFrame({"step": [1, 2], "loss": [2.0, 1.0]}).to_parquet(run / "train_log.parquet")
    inputs = {"plans": [str(root / x.plan_path) for x in cells],
              **{k: [str(root / x.run_dir / name) for x in cells]
                 for k, name in (("metrics", "metrics.json"), ("ledgers", "ledger.json"),
                                 ("train_logs", "train_log.parquet"))}}
    summary, _ = build_summary(c, inputs)
    assert list(summary.columns[:3]) == ["option", "dataset", "method"]
    assert set(summary["option"]) == {"bc"} and len(summary) == len(cells)
    assert set(summary["run_dir"]) == {x.run_dir for x in cells}
    base, _ = build_summary(aggregate_cells.config, aggregate_cells.inputs)
    assert "option" not in base.columns  # the grid's summary is as it was


# ---------------------------------------------------------------- claim 15


def _tables(effect: dict[str, float], noise: float = 0.0, seeds=(0, 1, 2), methods=("els", "uls")):
    """(summaries, options) of one dataset: base losses 3 + small seed noise; option = base + effect[method]."""
    rng = np.random.default_rng(0)
    rows, opt = [], []
    for m in methods:
        for eps in (1.0, 8.0, math.inf):
            for budget in (100, 400):
                for s in seeds:
                    loss = 3.0 - 0.1 * math.log(min(eps, 100)) + noise * rng.normal()
                    row = {"method": m, "epsilon": eps, "budget": budget, "seed": s, "is_group_sweep": False,
                           "test_loss": loss, "group_size": 1, "plan_noise_multiplier": 0.0 if math.isinf(eps) else 1.0,
                           "ledger_epsilon": eps}
                    rows.append(row)
                    if math.isfinite(eps) and m in effect:
                        opt.append({**row, "option": "x", "test_loss": loss + effect[m]
                                    + noise * rng.normal(), "plan_noise_multiplier": 1.25})
    return {"toy": pd.DataFrame(rows)}, {"toy": pd.DataFrame(opt)}


def test_claim_15_reads_off_the_option_minus_dp_sgd_with_an_interval():
    summaries, options = _tables({"els": -0.05, "uls": 0.04}, noise=0.005)
    rows = findings.option_findings(summaries, options, {"x": ["els", "uls"]})
    assert [(f.claim_id, f.domain) for f in rows] == [(15, findings.OPTIONS)] * 2
    els, uls = rows
    assert "(ELS)" in els.claim and els.claim.startswith("x: ")
    assert els.effect == pytest.approx(-0.05, abs=0.01) and els.ci_high < 0 and els.verdict == findings.REPRODUCED
    assert uls.effect == pytest.approx(0.04, abs=0.01) and uls.ci_low > 0 and uls.verdict == findings.NOT_REPRODUCED
    assert len(els.cells) == 4  # 2 epsilons x 2 budgets, one dataset
    assert "noise multiplier option / grid: 1.250" in els.detail and "epsilon 1:" in els.detail
    assert "differ by at most 0.00%" in els.detail and "left out" not in els.detail
    assert els.figure == "lm_options_loss_gap"


def test_claim_15_says_which_cells_and_seeds_it_left_out():
    summaries, options = _tables({"els": -0.05}, noise=0.005, methods=("els",))
    opt = options["toy"].copy()
    opt.loc[opt.index[0], "test_loss"] = math.nan  # a diverged seed
    opt = opt[~((opt["epsilon"] == 8.0) & (opt["budget"] == 400))]  # a cell that never ran
    (f,) = findings.option_findings(summaries, {"toy": opt}, {"x": ["els"]})
    assert len(f.cells) == 3 and f.verdict == findings.REPRODUCED
    assert "1 of the grid's 4 private cells have no finite option and grid values" in f.detail
    assert "1 non-finite seed value(s) left out" in f.detail
    # G-sweep rows of the summary are not the grid's cells of the comparison
    sweep = summaries["toy"].assign(is_group_sweep=True, test_loss=99.0)
    (g,) = findings.option_findings({"toy": pd.concat([summaries["toy"], sweep])}, options, {"x": ["els"]})
    assert g.effect == pytest.approx(-0.05, abs=0.01)


def test_claim_15_is_inconclusive_when_seed_noise_hides_the_effect():
    summaries, options = _tables({"els": 0.001}, noise=0.2)
    (f,) = findings.option_findings(summaries, options, {"x": ["els"]})
    assert "(ELS)" in f.claim
    assert f.ci_low < 0 < f.ci_high and f.verdict == findings.INCONCLUSIVE


def test_claim_15_is_not_measured_without_matching_cells_and_one_seed_is_inconclusive():
    summaries, options = _tables({"uls": -0.1}, methods=("uls",))
    rows = findings.option_findings(summaries, {"toy": options["toy"].assign(budget=999)}, {"x": ["uls"]})
    assert [f.verdict for f in rows] == [findings.NOT_MEASURED] and "no ULS cell of option 'x'" in rows[0].detail
    (f,) = findings.option_findings(summaries, options, {"absent": ["uls"]})
    assert f.verdict == findings.NOT_MEASURED and "no ULS cell of option 'absent'" in f.detail
    summaries, options = _tables({"uls": -0.1}, seeds=(0,), methods=("uls",))
    (f,) = findings.option_findings(summaries, options, {"x": ["uls"]})
    assert f.verdict == findings.INCONCLUSIVE and math.isinf(f.ci_high)  # one seed: no variance, no claim


def test_the_findings_table_has_claim_15_only_with_options():
    from userdp.evaluation import findings_job

    c = _config()
    # validation sorts every mapping's keys
    assert findings_job.params(c)["options"] == {"bc": ["els", "uls"], "clip": ["els", "uls"], "ftrl": ["uls"]}
    assert "options" not in findings_job.params(validate_config({"datasets": {"toy": {"source": "synthetic"}}}))
    summaries, options = _tables({"els": -0.05, "uls": 0.04}, noise=0.005)
    table = findings.build(summaries, {"toy": 4.0}, {"toy": None}, {"epsilon": 1.0, "budget": 100}, None, None,
                           0.01, 0.05, "t", options=(options, {"x": ["els", "uls"]}))
    assert sum(f["claim_id"] == 15 for f in table["findings"]) == 2
    table = findings.build(summaries, {"toy": 4.0}, {"toy": None}, {"epsilon": 1.0, "budget": 100}, None, None,
                           0.01, 0.05, "t")
    assert not any(f["claim_id"] == 15 for f in table["findings"])


# ---------------------------------------------------------------- figure


def test_the_loss_gap_figure_has_a_row_per_option_and_a_column_per_budget():
    import matplotlib.pyplot as plt

    from userdp.plotting.lm import options_loss_gap
    from userdp.plotting.registry import FIGURES, figure_targets

    summaries, options = _tables({"els": -0.05, "uls": 0.04}, noise=0.005)
    two = pd.concat([options["toy"], options["toy"].assign(option="y")], ignore_index=True)
    fig = options_loss_gap(summaries["toy"], two, "toy")
    axes = [a for a in fig.axes if a.get_visible()]
    assert len(axes) == 2 * 2
    assert [a.get_title().split(":")[0] for a in axes] == ["x", "x", "y", "y"]
    # per panel: DP-SGD and the option for each method, their gap to the non-private reference
    lines = [c.lines[0] for c in axes[0].containers]  # each errorbar's data line
    assert len(lines) == 4 and all(len(ln.get_xdata()) == 2 for ln in lines)
    gaps = {c.get_label(): np.asarray(c.lines[0].get_ydata(), float) for c in axes[0].containers}
    # the gap is the loss minus the non-private reference's: 0.1 log(100 / eps) here, the option's 0.05 lower (ELS)
    assert gaps["DP-SGD-ELS"] == pytest.approx(0.1 * np.log(100 / np.array([1, 8])), abs=0.01)
    assert gaps["ELS with the option"] - gaps["DP-SGD-ELS"] == pytest.approx([-0.05, -0.05], abs=0.01)
    assert gaps["ULS with the option"] - gaps["DP-SGD-ULS"] == pytest.approx([0.04, 0.04], abs=0.01)
    plt.close(fig)
    # without non-private references there is no gap: the figure says so instead of empty panels
    fig = options_loss_gap(summaries["toy"][np.isfinite(summaries["toy"]["epsilon"])], two, "toy")
    assert any("grid.nonprivate: false" in t.get_text() for t in fig.axes[0].texts)
    assert not any(a.containers for a in fig.axes)
    plt.close(fig)
    assert FIGURES["lm_options_loss_gap"].family.name == "options"
    assert "results/figures/lm_options_loss_gap_toy.png" in figure_targets(_config())
    assert not any("options" in t for t in figure_targets(validate_config({"datasets": {"toy": {"source": "synthetic"}}})))


def test_an_options_runs_draw_their_own_samples_and_noise():
    """An option's run is another released model of the same cell: it must not share the grid run's Poisson
    samples and noise (they would cancel between the two models; training.run_seeds), while the grid's own
    seeds stay as they were."""
    from userdp.training.run_seeds import run_seeds

    base = run_seeds(0, 1, "toy", "uls", "1", 100, 1, 0.001)
    assert run_seeds(0, 1, "toy", "uls", "1", 100, 1, 0.001, option=None) == base
    bc, ftrl = (run_seeds(0, 1, "toy", "uls", "1", 100, 1, 0.001, option=o) for o in ("bc", "ftrl"))
    audit = run_seeds(0, 1, "toy", "uls", "1", 100, 1, 0.001, audit=True)  # the audit's run of the same cell
    for k in ("sampler", "noise", "torch"):
        assert len({base[k], bc[k], ftrl[k], audit[k]}) == 4, k
