"""The rules' file sets, read off the DAG Snakemake builds (a dry run lists every job with its rule, inputs,
outputs and log) for small configs: what each job reads and writes as the config varies
(learning rates per job, LoRA adapters, a hub model, the G sweep, the audit)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

GRID = {
    "datasets": {"d": {"source": "synthetic"}, "b": {"source": "synthetic"}},
    "tokenizer": {"public_dataset": "d"},
    "grid": {"datasets": ["d"], "methods": ["els", "uls"], "epsilons": [1, 0.5],
             "budgets": [{"compute": 100, "steps": 5}], "seeds": [0], "group_size_sweep": [4]},
    "training": {"learning_rates": [0.001, 1e-05]},
}
# The same grid on a hub model with LoRA adapters, one job per run.
HUB = {**GRID, "model": {"name": "x/y", "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["c_attn"]}},
       "tokenizer": {"name": "x/y"}, "training": {**GRID["training"], "sweep_jobs": "per_run"}}


def snakemake_dry_run(tmp_path: Path, config: dict | None, *targets: str,
                      base: dict | None = None) -> subprocess.CompletedProcess:
    """A dry run for `targets` (rule all if none) with `config` over the default config (`base` instead)."""
    work = tmp_path / "work"
    (work / "config").mkdir(parents=True, exist_ok=True)
    default = (REPO / "config" / "config.yaml").read_text()
    (work / "config" / "config.yaml").write_text(default if base is None else yaml.safe_dump(base))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work),
           "--dry-run", "--cores", "1", *targets]
    if config is not None:
        (tmp_path / "extra.yaml").write_text(yaml.safe_dump(config))
        cmd += ["--configfile", str(tmp_path / "extra.yaml")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))


def dry_run(tmp_path: Path, config: dict | None, *targets: str) -> dict[str, dict]:
    """output file -> its job ({rule, log, inputs}) for every job of a dry run for `targets` (rule all if none)."""
    res = snakemake_dry_run(tmp_path, config, *targets)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    jobs, job = [], None
    for line in (res.stdout + res.stderr).splitlines():
        head = re.fullmatch(r"(?:local)?rule (\w+):", line.strip())
        if head:
            job = {"rule": head[1], "log": "", "inputs": set(), "input_list": [], "outputs": []}
            jobs.append(job)
        elif job is not None and (field := re.fullmatch(r"    (input|output|log): (.*)", line)):
            files = field[2].split(", ")
            if field[1] == "input":
                job["inputs"], job["input_list"] = set(files), files
            elif field[1] == "output":
                job["outputs"] = files
            else:
                job["log"] = field[2]
    return {f: j for j in jobs for f in j["outputs"]}


@pytest.fixture(scope="module")
def grid_dag(tmp_path_factory):
    return dry_run(tmp_path_factory.mktemp("grid"), GRID)


@pytest.fixture(scope="module")
def hub_dag(tmp_path_factory):
    return dry_run(tmp_path_factory.mktemp("hub"), HUB)


def test_every_cell_trains_every_rate_in_one_job_per_cell(grid_dag):
    ledgers = {f: job for f, job in grid_dag.items() if f.endswith("/ledger.json") and "/lr~" in f}
    # 2 methods x (2 eps + inf) x 1 budget + 2 G-sweep cells, x 2 learning rates
    assert len(ledgers) == (2 * 3 + 2) * 2
    run = "results/runs/d/method~uls/eps~0.5/budget~100/seed~0"
    job = grid_dag[f"{run}/lr~1e-05/ledger.json"]
    assert job["rule"] == "finetune" and job["log"] == "results/logs/finetune/d/method~uls/eps~0.5/budget~100/seed~0.log"
    one_job = sorted(f for f, j in grid_dag.items() if j["log"] == job["log"])
    assert one_job == sorted(f"{run}/lr~{lr}/{name}" for lr in ("0.001", "1e-05")
                             for name in ("ledger.json", "train_log.parquet", "model/config.json",
                                          "model/model.safetensors", "eval.json", "eval_users.parquet"))
    assert job["inputs"] == {"results/plan/d/method~uls/eps~0.5/budget~100.json", "results/data/d/tokens.parquet",
                             "results/tokenizer/tokenizer.json", "results/model/pretrained/model.safetensors",
                             "results/model/pretrained/config.json"}
    sweep = grid_dag["results/runs/d/method~uls/eps~1/budget~100/group~4/seed~0/lr~0.001/train_log.parquet"]
    assert sweep["rule"] == "finetune_group"
    assert "results/plan/d/method~uls/eps~1/budget~100/group~4.json" in sweep["inputs"]


def test_the_data_chain_reads_public_text_only_where_it_must(grid_dag):
    assert grid_dag["results/tokenizer/tokenizer.json"]["inputs"] == {"results/data/d/public.parquet"}
    assert grid_dag["results/model/pretrained/model.safetensors"]["inputs"] == {
        "results/tokenizer/tokenizer.json", "results/data/d/public_tokens.parquet"}
    plan = grid_dag["results/plan/d/method~els/eps~1/budget~100.json"]
    assert plan["inputs"] == {"results/data/d/users.parquet", "results/data/d/contributions.json"}
    # b is not a grid dataset: its data is prepared (contribution statistics), nothing is trained on it
    assert "results/data/b/contributions.json" in grid_dag
    assert not any(f.startswith(("results/runs/b/", "results/summary/b/", "results/plan/b/")) for f in grid_dag)


def test_evaluation_selects_each_cell_from_its_rates(grid_dag):
    cell = "results/runs/d/method~els/eps~inf/budget~100/seed~0"
    job = grid_dag[f"{cell}/metrics.json"]
    assert job["rule"] == "select_lr"
    assert job["inputs"] == {f"{cell}/lr~{lr}/{name}" for lr in ("0.001", "1e-05")
                             for name in ("eval.json", "eval_users.parquet", "ledger.json", "train_log.parquet")}
    assert grid_dag["results/runs/d/pretrained/metrics.json"]["rule"] == "evaluate_pretrained"
    metrics = {f for f in grid_dag if f.endswith("/metrics.json") and "/lr~" not in f and "pretrained" not in f}
    assert len(metrics) == 8
    summary = grid_dag["results/summary/d/metrics.parquet"]
    assert {f for f in summary["inputs"] if f.endswith("metrics.json")} == metrics
    groups = grid_dag["results/summary/d/groups.parquet"]
    assert "results/data/d/user_labels.parquet" in groups["inputs"]  # synthetic users have topic labels


def test_a_hub_model_with_lora_and_one_job_per_run(hub_dag):
    assert not any(f.startswith("results/model/") for f in hub_dag)  # nothing pretrained: the hub model is the base
    assert hub_dag["results/tokenizer/tokenizer.json"]["inputs"] == set()
    run = "results/runs/d/method~els/eps~1/budget~100/seed~0/lr~0.001"
    job = hub_dag[f"{run}/ledger.json"]
    assert job["log"] == "results/logs/finetune/d/method~els/eps~1/budget~100/seed~0/lr~0.001.log"
    assert sorted(f for f, j in hub_dag.items() if j["log"] == job["log"]) == sorted(
        f"{run}/{name}" for name in ("ledger.json", "train_log.parquet", "model/adapter_config.json",
                                     "model/adapter_model.safetensors", "eval.json", "eval_users.parquet"))
    assert not any(f.startswith("results/model/") for f in job["inputs"])


def test_the_audit_trains_and_scores_each_audited_cell(tmp_path):
    dag = dry_run(tmp_path, None, "audit")
    assert {"results/audit/synth/summary.parquet", "results/audit/synth/summary.csv",
            "results/audit/synth/table.html", "results/figures/audit_epsilon_synth.png"} <= set(dag)
    results = sorted(f for f, j in dag.items() if j["rule"] == "audit_score" and f.endswith(".json"))
    assert [r.split("/")[4:6] for r in results] == [
        ["method~els", "eps~8"], ["method~els", "eps~inf"], ["method~uls", "eps~8"], ["method~uls", "eps~inf"]]
    score = dag[results[0]]
    model = next(f for f in score["inputs"] if f.endswith("/model/model.safetensors"))
    assert dag[model]["rule"] == "audit_finetune"
    assert "results/audit/synth/canaries.parquet" in score["inputs"]
    assert not any(f.startswith("results/runs/") for f in dag)  # the audit never trains into the grid's folders


def test_no_public_text_for_the_tokenizer_is_a_clear_error(tmp_path):
    """tokenizer.name and model.name null need a dataset with public text; without one the DAG stops, naming
    the keys."""
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    base["datasets"] = {"so": {"source": "stackoverflow"}}
    base["grid"]["datasets"] = None
    base["tokenizer"]["public_dataset"] = None
    res = snakemake_dry_run(tmp_path, None, "results/tokenizer/tokenizer.json", base=base)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "tokenizer.name is null" in out and "no dataset has a public part" in out, out[-3000:]
    res = snakemake_dry_run(tmp_path, None, "results/data/so/contributions.json", base=base)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]  # what needs no public text still builds


def test_findings_read_the_audit_in_the_order_of_their_params(tmp_path):
    """findings.audit: rule findings reads each audited cell's result and scores, in the order of its
    `audit_cells` param (userdp.evaluation.findings_job.params zips them)."""
    from userdp.config import validate_config
    from userdp.evaluation.findings_job import params

    config = {**GRID, "findings": {"audit": True}}
    dag = dry_run(tmp_path, config, "results/findings/default.json")
    inputs = dag["results/findings/default.json"]["input_list"]
    results = [f for f in inputs if f.startswith("results/audit/") and f.endswith(".json")]
    scores = [f for f in inputs if f.startswith("results/audit/") and f.endswith(".parquet")]
    cells = params(validate_config(yaml.safe_load(yaml.safe_dump(config))))["audit_cells"]
    assert len(cells) == 4
    for (dataset, method, eps), result, score in zip(cells, results, scores, strict=True):
        prefix = f"results/audit/{dataset}/scores/method~{method}/eps~{eps}/"
        assert result.startswith(prefix) and score.startswith(prefix), (result, score, prefix)


def test_random_stopping_trains_each_private_cell_with_its_own_plan(tmp_path):
    """privacy.selection random_stopping: one job per private cell, reading the plan of that very cell (the G
    sweep's cells their group plan); the non-private references keep the sweep and select_lr."""
    dag = dry_run(tmp_path, {**GRID, "privacy": {"selection": {"accounting": "random_stopping"}}})
    jobs = {f: j for f, j in dag.items() if j["rule"] == "random_stopping" and f.endswith("/ledger.json")}
    assert len(jobs) == 2 * 2 + 2  # 2 methods x 2 epsilons, and the 2 G-sweep cells
    for ledger, job in jobs.items():
        cell = ledger.removeprefix("results/runs/d/").removesuffix("/seed~0/ledger.json")
        assert f"results/plan/d/{cell}.json" in job["inputs"], (ledger, job["inputs"])
    assert dag["results/runs/d/method~els/eps~inf/budget~100/seed~0/metrics.json"]["rule"] == "select_lr"


def test_options_run_each_private_cell_again_with_its_own_plan(tmp_path):
    """grid.options: each option copies the private cells of its methods (no eps~inf, no G sweep) into
    option~NAME/ folders, trained from the option's own plan; their summary and the findings read them all; the
    grid's own cells are the same jobs as without options. With random stopping, an option cell is one job too."""
    options = {"bc": {"training": {"optimizer": "adam_bc"}},
               "ftrl": {"methods": ["uls"], "privacy": {"correlated_noise": {"bands": 2}}}}
    dag = dry_run(tmp_path / "a", {**GRID, "grid": {**GRID["grid"], "options": options}})
    plain = dry_run(tmp_path / "b", GRID)
    trained = {f: j for f, j in dag.items() if j["rule"] == "finetune_option" and f.endswith("/ledger.json")}
    cells = {f.removeprefix("results/runs/d/").rsplit("/seed~0/", 1)[0] for f in trained}
    assert cells == {f"option~bc/method~{m}/eps~{e}/budget~100" for m in ("els", "uls") for e in ("1", "0.5")} | {
        f"option~ftrl/method~uls/eps~{e}/budget~100" for e in ("1", "0.5")}
    assert len(trained) == len(cells) * 2  # every learning rate
    for ledger, job in trained.items():
        cell = ledger.removeprefix("results/runs/d/").rsplit("/seed~0/", 1)[0]
        assert f"results/plan/d/{cell}.json" in job["inputs"]
        assert dag[f"results/plan/d/{cell}.json"]["rule"] == "plan_option"
        assert dag[ledger.rsplit("/lr~", 1)[0] + "/metrics.json"]["rule"] == "select_lr"
    summary = dag["results/summary/d/options.parquet"]
    assert summary["rule"] == "aggregate_options"
    assert {f for f in summary["inputs"] if f.endswith("metrics.json")} == {
        f"results/runs/d/{c}/seed~0/metrics.json" for c in cells}
    assert "results/summary/d/options.parquet" in dag["results/findings/default.json"]["inputs"]
    assert dag["results/figures/lm_options_loss_gap_d.png"]["inputs"] == {"results/summary/d/metrics.parquet",
                                                                          "results/summary/d/options.parquet"}
    # the grid's own jobs are untouched: same outputs, same inputs
    for f, job in plain.items():
        if "/option~" not in f and job["rule"] not in ("all", "findings"):
            assert dag[f]["rule"] == job["rule"] and dag[f]["inputs"] == job["inputs"], f
    rs = dry_run(tmp_path / "c", {**GRID, "grid": {**GRID["grid"], "options": options},
                                  "privacy": {"selection": {"accounting": "random_stopping"}}})
    stopped = {f: j for f, j in rs.items() if j["rule"] == "random_stopping" and "/option~" in f
               and f.endswith("/ledger.json")}
    assert len(stopped) == len(cells)
    for ledger, job in stopped.items():
        cell = ledger.removeprefix("results/runs/d/").removesuffix("/seed~0/ledger.json")
        assert f"results/plan/d/{cell}.json" in job["inputs"]
