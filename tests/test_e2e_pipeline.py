"""The real workflow, end to end, on a tiny config: every stage and artifact.

Runs `snakemake` (the default target `all`) in a temporary directory with
tests/configs/tiny.yaml, then checks every artifact of the contract
(docs/artifacts.md) for its fields, builds the HTML report, and
checks that a second invocation has nothing to do. It also checks one
scientific outcome that must hold even at this size: non-private fine-tuning
lowers the test loss of the pretrained model.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "configs" / "tiny.yaml"

pytestmark = pytest.mark.integration


def snakemake(workdir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
        "--configfile", str(CONFIG), "--replace-workflow-config", "--cores", "2", *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("e2e")
    proc = snakemake(workdir)
    if proc.returncode != 0:
        pytest.fail(f"snakemake failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return workdir


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def columns(path: Path) -> set[str]:
    return set(pq.read_schema(path).names)


def test_data_artifacts(run):
    d = run / "results/data/tiny"
    assert {"user_id", "example_id", "split", "text"} <= columns(d / "examples.parquet")
    assert {"user_id", "split", "n_examples"} <= columns(d / "users.parquet")
    assert {"user_id", "example_id", "split", "input_ids", "n_tokens"} <= columns(d / "tokens.parquet")
    assert "text" in columns(d / "public.parquet")
    stats = load(d / "contributions.json")
    for key in ["n_users", "n_examples", "median_train", "max_train", "quantiles_train", "dropped"]:
        assert key in stats, key
    assert set(stats["n_users"]) == {"train", "validation", "test"}
    users = pq.read_table(d / "users.parquet").to_pandas()
    # users are in exactly one split
    assert users["user_id"].is_unique
    assert (run / "results/figures/contributions_tiny.png").stat().st_size > 10_000


PLAN_FIELDS = [
    "method", "epsilon", "delta", "group_size", "sampling_rate", "steps", "expected_batch",
    "noise_multiplier", "epsilon_achieved", "compute_budget", "accountant", "group_size_rule",
]


def cells():
    for method in ["els", "uls"]:
        for eps in ["4", "inf"]:
            yield method, eps


@pytest.mark.parametrize("method,eps", list(cells()))
def test_plan_run_and_metrics(run, method, eps):
    plan = load(run / f"results/plan/tiny/method~{method}/eps~{eps}/budget~960.json")
    for key in PLAN_FIELDS:
        assert key in plan, key
    assert plan["method"] == method and plan["steps"] == 12
    cell = run / f"results/runs/tiny/method~{method}/eps~{eps}/budget~960/seed~0"
    ledger = load(cell / "ledger.json")
    assert ledger["steps_completed"] == 12
    if eps == "inf":
        assert ledger["noise_multiplier"] == 0
    else:
        assert ledger["noise_multiplier"] == pytest.approx(plan["noise_multiplier"])
        # epsilon recomputed from what ran equals the plan's epsilon
        assert float(ledger["epsilon"]) == pytest.approx(plan["epsilon_achieved"], rel=1e-6)
        assert float(ledger["epsilon"]) <= 4.0
    log = pq.read_table(cell / "train_log.parquet").to_pandas()
    assert list(log["step"]) == list(range(1, 13))
    # training.debug_step_log off (the default): only values inside the guarantee leave the run
    assert list(log.columns) == ["step", "learning_rate", "update_norm", "update_signal_norm"]
    assert log["update_norm"].gt(0).all() and log["update_norm"].nunique() > 1
    # synthetic data: seeds derived from the config (privacy.secret_seeds null), and the ledger says so
    assert ledger["seeds_mode"] == "derived" and "anyone holding the config" in ledger["guarantee_caveat"]
    metrics = load(cell / "metrics.json")
    for key in ["test_loss", "test_loss_user_macro", "test_perplexity", "test_accuracy", "learning_rate"]:
        assert key in metrics, key
    # one learning rate: nothing to choose, so validation users are not scored (evaluation.validation: auto)
    from userdp.evaluation.select import ONLY_RATE

    assert "validation_loss" not in metrics and metrics["selection"] == ONLY_RATE
    assert metrics["evaluation"]["splits"] == ["test"]
    assert metrics["test_perplexity"] == pytest.approx(math.exp(metrics["test_loss"]), rel=1e-6)


def test_nonprivate_beats_pretrained(run):
    pre = load(run / "results/runs/tiny/pretrained/metrics.json")
    for method in ["els", "uls"]:
        ft = load(run / f"results/runs/tiny/method~{method}/eps~inf/budget~960/seed~0/metrics.json")
        assert ft["test_loss"] < pre["test_loss"], (method, ft["test_loss"], pre["test_loss"])


def test_summaries_and_studies(run):
    summary = pq.read_table(run / "results/summary/tiny/metrics.parquet").to_pandas()
    assert len(summary) == 4
    assert {"method", "epsilon", "test_loss"} <= set(summary.columns)
    assert (run / "results/summary/tiny/metrics.csv").exists()
    comp = pq.read_table(run / "results/accounting/comparison.parquet").to_pandas()
    assert len(comp) > 0
    me = pq.read_table(run / "results/mean_estimation/results.parquet").to_pandas()
    assert {"method", "epsilon", "compute_budget", "diversity", "group_size", "seed", "squared_error"} <= set(me.columns)
    assert set(me["method"]) == {"els", "uls"}


FIGURES = [
    "contributions_tiny", "noise_vs_group_size", "lm_loss_vs_epsilon_tiny", "lm_loss_vs_budget_tiny",
    "lm_loss_vs_group_size_tiny", "training_curves_tiny", "mean_estimation_vs_epsilon",
    "mean_estimation_vs_diversity", "mean_estimation_vs_budget", "mean_estimation_vs_group_size",
]


def test_every_figure_and_the_report(run):
    for name in FIGURES:
        for ext in ["png", "pdf"]:
            path = run / "results/figures" / f"{name}.{ext}"
            assert path.exists() and path.stat().st_size > 1000, path
    proc = snakemake(run, "--report", "results/report.html", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    html = (run / "results/report.html").read_text(errors="replace")
    for name in FIGURES:
        assert f"{name}.png" in html, name
    assert "metrics.csv" in html  # the summary table
    assert "noise_vs_group_size.pdf" in html


def test_second_invocation_does_nothing(run):
    proc = snakemake(run, "-n")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_random_stopping_cell_in_a_real_run(run, tmp_path):
    """privacy.selection.accounting: random_stopping through the real rules, on a copy of the run's outputs.

    One private cell: its plan is redone for the selection, rule random_stopping trains a random number of
    runs and releases the best into the cell folder (model included), with no lr~ folders and no state left.
    """
    import shutil

    work = tmp_path / "rs"
    shutil.copytree(run, work, symlinks=True)
    cell = work / "results/runs/tiny/method~uls/eps~4/budget~960/seed~0"
    shutil.rmtree(cell)
    extra = tmp_path / "rs.yaml"
    extra.write_text("privacy:\n  selection: {accounting: random_stopping, mean_runs: 2}\n"
                     "training:\n  learning_rates: [0.003, 0.01]\n")
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work),
           "--configfile", str(CONFIG), str(extra), "--replace-workflow-config", "--cores", "2",
           str(cell.relative_to(work) / "metrics.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rule random_stopping" in proc.stdout + proc.stderr and "rule finetune:" not in proc.stdout + proc.stderr
    ledger, metrics = load(cell / "ledger.json"), load(cell / "metrics.json")
    assert ledger["selection"] == {"accounting": "random_stopping", "candidates": 2, "mean_runs": 2.0, "shape": 1.0}
    assert ledger["epsilon"] <= 4 * 1.001 and ledger["epsilon_one_run"] < ledger["epsilon"]
    assert len(metrics["learning_rate_sweep"]) == ledger["random_stopping"]["runs"] >= 1  # derived seeds: synthetic
    assert metrics["learning_rate"] in (0.003, 0.01) and math.isfinite(metrics["test_loss"])
    assert (cell / "model" / "model.safetensors").stat().st_size > 1000
    assert sorted(p.name for p in cell.iterdir()) == ["ledger.json", "metrics.json", "model", "train_log.parquet",
                                                      "users.parquet"]
    # no benchmark file: the job's wall time would reveal the number of runs K (docs/privacy.md)
    benchmarks = work / "results" / "benchmarks"
    assert benchmarks.is_dir() and not list(benchmarks.rglob("*random_stopping*"))


def test_an_evaluation_change_rescores_runs_without_training_them(run, tmp_path):
    """Each fine-tuning job evaluates its runs, so an evaluation setting reruns it: the job restores each finished
    run from its finished/ record (same model and ledger, byte for byte; no step trained) and scores it again."""
    import shutil

    work = tmp_path / "ev"
    shutil.copytree(run, work, symlinks=True)
    cell = work / "results/runs/tiny/method~els/eps~4/budget~960/seed~0"
    runs = sorted(cell.glob("lr~*"))
    before = {p: p.read_bytes() for r in runs for p in (r / "ledger.json", r / "model" / "model.safetensors")}
    extra = tmp_path / "ev.yaml"
    extra.write_text("evaluation:\n  max_users: 7\n")
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work),
           "--configfile", str(CONFIG), str(extra), "--replace-workflow-config", "--cores", "2",
           str(cell.relative_to(work) / "metrics.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rule finetune:" in out and "rule pretrain" not in out and "rule plan:" not in out
    log = (work / "results/logs/finetune/tiny/method~els/eps~4/budget~960/seed~0.log").read_text()
    last = log.rsplit("===== attempt started", 1)[-1]  # (the restore appends the finished attempt's lines)
    assert last.count("restored the finished outputs") == len(runs)
    assert {p: p.read_bytes() for p in before} == before
    for r in runs:
        assert load(r / "eval.json")["test_n_users"] == 7
    assert load(cell / "metrics.json")["test_n_users"] == 7


def test_options_run_beside_the_grid_in_a_real_run(run, tmp_path):
    """grid.options through the real rules, on a copy of the run's outputs: DP-Adam-BC for both methods and
    DP-FTRL for ULS run as copies of the private cells, each from its own plan (same target epsilon), while no
    grid job reruns; their summary, claim 15 of the findings and the loss-gap figure come out; a second
    invocation has nothing to do."""
    import shutil

    import pandas as pd

    work = tmp_path / "opt"
    shutil.copytree(run, work, symlinks=True)
    extra = tmp_path / "options.yaml"
    extra.write_text("grid:\n  options:\n    bc: {training: {optimizer: adam_bc}}\n"
                     "    ftrl: {methods: [uls], privacy: {correlated_noise: {bands: 2}}}\n")
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(work),
           "--configfile", str(CONFIG), str(extra), "--replace-workflow-config", "--cores", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    ran = set(re.findall(r"^(?:local)?rule (\w+):", out, flags=re.M))
    assert ran == {"plan_option", "finetune_option", "select_lr", "aggregate_options", "findings",
                   "plot_lm_options_loss_gap", "all"}, ran
    runs = work / "results/runs/tiny"
    base = load(runs / "method~uls/eps~4/budget~960/seed~0/ledger.json")
    for option, method in (("bc", "els"), ("bc", "uls"), ("ftrl", "uls")):
        cell = runs / f"option~{option}/method~{method}/eps~4/budget~960/seed~0"
        ledger, plan = load(cell / "ledger.json"), load(work / f"results/plan/tiny/option~{option}/method~{method}/eps~4/budget~960.json")
        assert ledger["epsilon"] <= 4 * 1.001 and ledger["epsilon"] == pytest.approx(plan["epsilon_achieved"], rel=1e-6)
        assert ledger["optimizer"] == ("adam_bc" if option == "bc" else "adam")
        assert ("correlated_noise" in ledger) == (option == "ftrl") == ("correlated_noise" in plan)
        assert math.isfinite(load(cell / "metrics.json")["test_loss"])
    ftrl = load(runs / "option~ftrl/method~uls/eps~4/budget~960/seed~0/ledger.json")
    assert ftrl["correlated_noise"]["bands"] == 2 and ftrl["noise_multiplier"] != base["noise_multiplier"]
    table = pd.read_parquet(work / "results/summary/tiny/options.parquet")
    assert sorted(zip(table["option"], table["method"])) == [("bc", "els"), ("bc", "uls"), ("ftrl", "uls")]
    rows = [f for f in load(work / "results/findings/default.json")["findings"] if f["claim_id"] == 15]
    assert [r["claim"].split(":")[0] for r in rows] == ["bc", "bc", "ftrl"]
    assert all(r["verdict"] == "inconclusive" for r in rows)  # one seed: no interval, no claim
    assert (work / "results/figures/lm_options_loss_gap_tiny.png").stat().st_size > 10_000
    again = subprocess.run([*cmd, "-n"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    # each option's keys reach its own jobs' params: DP-FTRL's bands its plan, DP-AdamBC's training keys its runs
    extra.write_text("grid:\n  options:\n    bc: {training: {optimizer: adam_bc, warmup_steps: 2}}\n"
                     "    ftrl: {methods: [uls], privacy: {correlated_noise: {bands: 3}}}\n")
    changed = subprocess.run([*cmd, "-n"], capture_output=True, text=True, timeout=300)
    assert changed.returncode == 0, (changed.stdout + changed.stderr)[-4000:]
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    output: (\S+)", changed.stdout, flags=re.M)
    planned = sorted(o for r, o in jobs if r == "plan_option")
    trained = sorted(o.split("/seed~")[0] for r, o in jobs if r == "finetune_option")
    assert planned == ["results/plan/tiny/option~ftrl/method~uls/eps~4/budget~960.json"], jobs
    assert trained == [f"results/runs/tiny/option~{o}/method~{m}/eps~4/budget~960"
                       for o, m in (("bc", "els"), ("bc", "uls"), ("ftrl", "uls"))], jobs
    assert not {r for r, _ in jobs} & {"plan", "finetune", "finetune_group"}
