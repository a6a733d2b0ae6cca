"""The workflow layout (userdp.layout): templates format to the artifacts' paths, one owner of path text."""

import ast
import io
import math
import re
import tokenize
from pathlib import Path

import pytest

from userdp import layout
from userdp.config import validate_config
from userdp.layout import fmt_num
from userdp.grid import Cell, cell_of_dir, iter_cells

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
        cell_text = (layout.GROUP_CELL if cell.group_size else layout.CELL).format(**w)
        assert cell.plan_path == plan.format(**w)
        assert cell.lr_dir(0.001) == layout.RUN_DIR.format(dataset=cell.dataset, cell=cell_text, lr="0.001")
        assert cell.run_dir == layout.CELL_DIR.format(dataset=cell.dataset, cell=cell.cell)


def test_data_templates():
    assert layout.TOKENS.format(dataset="d") == "results/data/d/tokens.parquet"
    assert layout.PRETRAINED_METRICS.format(dataset="d") == "results/runs/d/pretrained/metrics.json"
    assert layout.SUMMARY.format(dataset="d") == "results/summary/d/metrics.parquet"
    assert [f"{layout.PRETRAINED}/{name}" for name in layout.MODEL_FILES] == [
        "results/model/pretrained/config.json", "results/model/pretrained/model.safetensors"]


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


# Path text only layout.py (for the library) and the rules may spell: the plan and run folders and the cell naming.
_LAYOUT_TEXT = ("results/plan/", "results/runs/", "method~")
RULE_FILES = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]


def _library_files():
    wf = REPO / "workflow"
    files = [*sorted((wf / "scripts").glob("*.py")), *sorted((wf / "userdp").rglob("*.py"))]
    return [f for f in files if f != wf / "userdp" / "layout.py"]


def test_only_layout_and_the_rules_spell_plan_and_run_paths():
    offenders = [f"{f.relative_to(REPO)}: {text!r}" for f in _library_files()
                 for text in _LAYOUT_TEXT if text in f.read_text(encoding="utf-8")]
    assert not offenders, "path text outside userdp/layout.py and the rules (use its templates): " + "; ".join(offenders)


def rule_paths(files) -> set[str]:
    """The paths the rules write out: every plain string literal of the rule files under results/ or data/."""
    out = set()
    for f in files:
        for tok in tokenize.generate_tokens(io.StringIO(Path(f).read_text(encoding="utf-8")).readline):
            if tok.type == tokenize.STRING and not re.match(r"[rRbBuU]*[fF]", tok.string):
                value = ast.literal_eval(tok.string)
                if value.startswith(("results/", "data/")):
                    out.add(value)
    return out


def templates_not_in_rules(templates: dict[str, str], paths: set[str]) -> list[str]:
    """The layout templates that no rule path spells, as a file or as the folder of one; a template with {cell}
    may appear as it is or with the cell's levels written out (a cell, a G-sweep cell)."""
    missing = []
    for name, template in templates.items():
        forms = {template} | ({template.replace("{cell}", layout.CELL), template.replace("{cell}", layout.GROUP_CELL)}
                              if "{cell}" in template else set())
        if not any(p == t or p.startswith(t + "/") for t in forms for p in paths):
            missing.append(f"{name} = {template!r}")
    return missing


#: Templates of layout that name no file the rules write: the accountant's memo (an environment default).
NOT_RULE_PATHS = {"ACCOUNTING_MEMO"}


def layout_templates() -> dict[str, str]:
    return {name: v for name, v in vars(layout).items()
            if name.isupper() and isinstance(v, str) and v.startswith(("results/", "data"))
            and name not in NOT_RULE_PATHS}


def test_every_layout_template_is_a_path_the_rules_spell():
    """One fact, two readers: the rules write paths out (so the DAG reads off them), the library formats layout's
    templates; each template must be one the rules spell, or the library would look where no rule writes."""
    assert len(layout_templates()) > 20
    missing = templates_not_in_rules(layout_templates(), rule_paths(RULE_FILES))
    assert not missing, "layout templates no rule spells (fix the template or the rule): " + "; ".join(missing)


def test_the_template_check_can_fail(tmp_path):
    rules = tmp_path / "x.smk"
    rules.write_text('rule a:\n    output:\n        "results/plan/{dataset}/method~{method}.json",\n'
                     '    log:\n        f"results/logs/{NAME}.log",\n')
    assert rule_paths([rules]) == {"results/plan/{dataset}/method~{method}.json"}  # f-strings are not literals
    assert templates_not_in_rules({"PLAN": layout.PLAN}, rule_paths([rules])) == [f"PLAN = {layout.PLAN!r}"]
    assert templates_not_in_rules({"RUNS": "results/plan/{dataset}"}, rule_paths([rules])) == []


def test_every_benchmark_file_mirrors_a_log():
    """A job's benchmark file is its log's path under results/benchmarks (benchmarks/profile_pipeline.py pairs
    them); only random stopping has none (its wall time would reveal its secret number of runs)."""
    paths = rule_paths(RULE_FILES)
    logs = {p for p in paths if p.startswith(layout.LOGS + "/")}
    benchmarks = {p for p in paths if p.startswith(layout.BENCHMARKS + "/")}
    assert benchmarks == {layout.benchmark_of(p) for p in logs} - {
        "results/benchmarks/random_stopping/{dataset}/{cell}.tsv"}


def test_targets_given_to_configfile_are_recognised():
    from userdp.layout import looks_like_artifact

    for target in ["results/runs/synth/method~uls/eps~1/budget~8000/seed~0/metrics.json", "/w/results/report.html",
                   "results/figures/x.png", "out/metrics.csv"]:
        assert looks_like_artifact(target), target
    for config_file in ["config/paper.yaml", "my.yaml", "settings.json", "/home/me/cfg.yml"]:
        assert not looks_like_artifact(config_file), config_file
