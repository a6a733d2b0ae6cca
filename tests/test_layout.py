"""The workflow layout (userdp.layout): templates format to the artifacts' paths, one owner of path text."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from userdp import layout
from userdp.config import validate_config
from userdp.layout import fmt_num
from userdp.grid import Cell, cell_of_dir, iter_cells
from userdp.training.targets import finetune_inputs, run_outputs

REPO = Path(__file__).resolve().parents[1]

NORMAL = Cell("synth", "els", 0.5, 960, 48, 1)
SWEEP = Cell("synth", "uls", 4.0, 960, 48, 0, 8)


def test_cell_paths_of_a_normal_and_a_group_sweep_cell():
    assert NORMAL.plan_path == "results/plan/synth/method~els/eps~0.5/budget~960.json"
    assert NORMAL.run_dir == "results/runs/synth/method~els/eps~0.5/budget~960/seed~1"
    assert NORMAL.lr_dir(1e-05) == "results/runs/synth/method~els/eps~0.5/budget~960/seed~1/lr~1e-05"
    assert SWEEP.plan_path == "results/plan/synth/method~uls/eps~4/budget~960/group~8.json"
    assert SWEEP.run_dir == "results/runs/synth/method~uls/eps~4/budget~960/group~8/seed~0"
    assert SWEEP.lr_dir(0.003) == "results/runs/synth/method~uls/eps~4/budget~960/group~8/seed~0/lr~0.003"
    ref = Cell("synth", "els", math.inf, 960, 48, 0)
    assert ref.plan_path == "results/plan/synth/method~els/eps~inf/budget~960.json"


def test_cell_paths_are_the_templates_formatted():
    for cell in (NORMAL, SWEEP):
        w = {"dataset": cell.dataset, "method": cell.method, "eps": fmt_num(cell.epsilon), "budget": cell.compute,
             "seed": cell.seed, "group": cell.group_size, "lr": "0.001"}
        plan = layout.GROUP_PLAN if cell.group_size else layout.PLAN
        run = layout.FINETUNE_GROUP_RUN_DIR if cell.group_size else layout.FINETUNE_RUN_DIR
        assert cell.plan_path == plan.format(**w)
        assert cell.lr_dir(0.001) == run.format(**w)
        assert cell.run_dir == layout.CELL_DIR.format(dataset=cell.dataset, cell=cell.cell)


def test_rule_finetune_reads_the_plan_of_its_cell_and_writes_into_its_run_dir():
    cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}},
                           "grid": {"budgets": [{"compute": 960, "steps": 48}], "group_size_sweep": [8]}})
    for cell in (NORMAL, SWEEP):
        wc = SimpleNamespace(dataset=cell.dataset, method=cell.method, eps=cell.eps_text, budget=str(cell.compute),
                             seed=str(cell.seed), lr="0.001", group=None if cell.group_size is None else str(cell.group_size))
        assert finetune_inputs(cfg, wc)["plan"] == cell.plan_path
        assert run_outputs(cell.lr_dir(0.001), cfg)["ledger"] == f"{cell.run_dir}/lr~0.001/ledger.json"


def test_data_templates():
    assert layout.TOKENS.format(dataset="d") == "results/data/d/tokens.parquet"
    assert layout.DOWNLOAD.format(dataset="d") == "data/d/download.json"
    assert layout.PRETRAINED_METRICS.format(dataset="d") == "results/runs/d/pretrained/metrics.json"
    assert layout.SUMMARY.format(dataset="d") == "results/summary/d/metrics.parquet"
    assert layout.model_files(layout.PRETRAINED) == ["results/model/pretrained/config.json",
                                                     "results/model/pretrained/model.safetensors"]


@pytest.mark.parametrize("value", [1e-05, 0.5, 4, 1e16, 2.5e-7])
def test_eps_and_lr_regexes_accept_fmt_num_text(value):
    text = fmt_num(value)
    assert re.fullmatch(layout.EPS_RE, text) and re.fullmatch(layout.LR_RE, text), text


def test_eps_regex_accepts_inf_and_both_reject_a_plus_exponent():
    assert re.fullmatch(layout.EPS_RE, fmt_num(math.inf)) and not re.fullmatch(layout.LR_RE, "inf")
    for text in ("1e+16", "-1", "1.", ".5", "nan"):
        assert not re.fullmatch(layout.EPS_RE, text) and not re.fullmatch(layout.LR_RE, text), text


def test_cell_regex_and_cell_of_dir_invert_the_run_dirs():
    cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}},
                           "grid": {"epsilons": [0.5, 4], "budgets": [{"compute": 960, "steps": 48}],
                                    "seeds": [0, 1], "group_size_sweep": [8]}})
    cells = list(iter_cells(cfg))
    assert any(c.group_size for c in cells) and any(math.isinf(c.epsilon) for c in cells)
    for cell in cells:
        assert re.fullmatch(layout.CELL_RE, cell.cell), cell.cell
        assert not re.fullmatch(layout.CELL_RE, cell.cell + "/lr~0.001")
        assert cell_of_dir(cell.run_dir, cfg) == cell
        assert cell_of_dir(f"/some/root/{cell.run_dir}/", cfg) == cell
    with pytest.raises(ValueError, match="not a grid cell"):
        cell_of_dir(NORMAL.lr_dir(0.001), cfg)


# Path text only layout.py may spell: the plan and run folders and the cell naming.
_LAYOUT_TEXT = ("results/plan/", "results/runs/", "method~")


def _workflow_files():
    wf = REPO / "workflow"
    files = [REPO / "Snakefile", *sorted((wf / "rules").glob("*.smk")), *sorted((wf / "scripts").glob("*.py")),
             *sorted((wf / "userdp").rglob("*.py"))]
    return [f for f in files if f != wf / "userdp" / "layout.py"]


def test_only_layout_spells_plan_and_run_paths():
    offenders = [f"{f.relative_to(REPO)}: {text!r}" for f in _workflow_files()
                 for text in _LAYOUT_TEXT if text in f.read_text(encoding="utf-8")]
    assert not offenders, "path text outside userdp/layout.py (use its templates): " + "; ".join(offenders)


def test_targets_given_to_configfile_are_recognised():
    from userdp.layout import looks_like_artifact

    for target in ["results/runs/synth/method~uls/eps~1/budget~8000/seed~0/metrics.json", "/w/results/report.html",
                   "results/figures/x.png", "out/metrics.csv"]:
        assert looks_like_artifact(target), target
    for config_file in ["config/paper.yaml", "my.yaml", "settings.json", "/home/me/cfg.yml"]:
        assert not looks_like_artifact(config_file), config_file
