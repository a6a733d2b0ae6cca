"""The evaluation rules in a real snakemake run on hand-built training outputs.

Runs only this stage's rules (--allowed-rules), so the hand-built tokens,
plans, pretrained model and per-learning-rate runs stand in for the data,
plan and training stages; each run's eval.json and eval_users.parquet are
written as its fine-tuning job writes them (userdp.evaluation.metrics.evaluate_runs,
with rule finetune's `evaluation` param).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from eval_builders import plan_record, tiny_gpt2, tokens_table
from userdp.config import validate_config
from userdp.evaluation.metrics import evaluate_runs
from userdp.evaluation.targets import evaluation_params
from userdp.grid import iter_cells
from userdp.layout import fmt_num
from userdp.io import read_json, write_json

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
RULES = ["evaluation", "evaluate_pretrained", "select_lr", "aggregate", "plot_lm_loss_vs_epsilon",
         "plot_lm_loss_vs_budget", "plot_lm_loss_vs_group_size", "plot_training_curves", "plot_lm_uls_minus_els",
         "groups", "plot_groups_cost", "plot_groups_gap_vs_examples"]

CONFIG = {
    "datasets": {"toy": {"source": "synthetic", "split": {"validation": 0.2, "test": 0.2}}},
    "grid": {"datasets": ["toy"], "methods": ["uls"], "epsilons": [2], "nonprivate": True,
             "budgets": [{"compute": 100, "steps": 6}], "seeds": [0], "group_size_sweep": [2]},
    "training": {"learning_rates": [0.001, 0.01], "threads": 1, "device": "cpu"},
    "evaluation": {"max_users": 3, "batch_size": 4},
}


def build_inputs(root: Path) -> dict:
    cfg = validate_config(json.loads(json.dumps(CONFIG)))
    tokens_table(root / "results/data/toy/tokens.parquet", {"train": 5, "validation": 4, "test": 4})
    users = sorted(set(pd.read_parquet(root / "results/data/toy/tokens.parquet")["user_id"]))
    # the data stage's user labels (rule user_labels) of a synthetic dataset, for rule groups
    pd.DataFrame({"user_id": users, "kind": "topic",
                  "label": ["rare" if i % 2 else "common" for i in range(len(users))]}).to_parquet(
        root / "results/data/toy/user_labels.parquet")
    tiny_gpt2(root / "results/model/pretrained", seed=0)
    for i, cell in enumerate(iter_cells(cfg)):
        g = cell.group_size or (3 if cell.method == "els" else 4)
        plan = plan_record(cell.method, cell.epsilon, delta=1e-3, group_size=g, steps=cell.steps)
        write_json(root / cell.plan_path, plan)
        # the mechanism fields a real ledger has (select renders the cell's model card from them)
        mechanism = {k: plan[k] for k in ("sampling_rate", "noise_multiplier", "clip_norm", "clipping", "group_size",
                                           "delta", "accountant", "epsilon")}
        for j, lr in enumerate(cfg["training"]["learning_rates"]):
            run = root / cell.run_dir / f"lr~{fmt_num(lr)}"
            tiny_gpt2(run / "model", seed=100 + 10 * i + j)
            write_json(run / "ledger.json", {**mechanism, "method": cell.method, "learning_rate": lr,
                                             "steps_completed": 6})
            pd.DataFrame({"step": range(1, 7), "loss": [4.5 - 0.1 * s - j for s in range(6)],
                          "update_signal_norm": [2.0 - 0.1 * s - j for s in range(6)]}).to_parquet(
                run / "train_log.parquet")
        # what rule finetune's job does after training: each run's model scored on held-out users
        ev = evaluation_params(cfg)
        runs = [(lr, str(root / cell.run_dir / f"lr~{fmt_num(lr)}")) for lr in cfg["training"]["learning_rates"]]
        evaluate_runs(runs, root / "results/data/toy/tokens.parquet", dataset="toy", root_seed=ev["seed"],
                      max_users=ev["max_users"], batch_size=4, device="cpu", splits=ev.get("splits", ("validation", "test")))
    (root / "extra.yaml").write_text(yaml.safe_dump(CONFIG))
    return cfg


def snakemake(root: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(root),
           "--configfile", str(root / "extra.yaml"), "--cores", "2", *args, "--allowed-rules", *RULES]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.integration
def test_evaluation_stage_runs_end_to_end(tmp_path):
    cfg = build_inputs(tmp_path)
    cells = list(iter_cells(cfg))
    figures = [f"results/figures/{n}_toy.{e}" for n in ("lm_loss_vs_epsilon", "lm_loss_vs_budget",
                                                       "lm_loss_vs_group_size", "training_curves")
               for e in ("png", "pdf")]
    wanted = [f"{c.run_dir}/metrics.json" for c in cells] + [
        "results/runs/toy/pretrained/metrics.json", "results/summary/toy/metrics.csv",
        "results/summary/toy/groups.csv", "results/summary/toy/users.parquet"] + figures
    assert set(wanted) < set(evaluation_targets(tmp_path))
    res = snakemake(tmp_path, "evaluation")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]

    for c in cells:
        m = read_json(tmp_path / c.run_dir / "metrics.json")
        evals = {lr: read_json(tmp_path / c.run_dir / f"lr~{fmt_num(lr)}" / "eval.json")
                 for lr in cfg["training"]["learning_rates"]}
        best = min(evals, key=lambda lr: evals[lr]["validation_loss"])
        assert m["learning_rate"] == best
        assert m["test_loss"] == evals[best]["test_loss"]
        assert m["test_perplexity"] == pytest.approx(math.exp(m["test_loss"]))
        assert m["test_n_users"] == 3  # evaluation.max_users
        led = read_json(tmp_path / c.run_dir / "ledger.json")
        assert led["learning_rate"] == best and led["learning_rates_tried"] == 2
    pre = read_json(tmp_path / "results/runs/toy/pretrained/metrics.json")
    assert pre["learning_rate"] is None and pre["test_loss"] > 0
    summary = pd.read_parquet(tmp_path / "results/summary/toy/metrics.parquet")
    assert len(summary) == len(cells)
    assert set(summary["epsilon"]) == {2.0, math.inf}
    assert summary["is_group_sweep"].sum() == 1
    for f in figures:
        assert (tmp_path / f).stat().st_size > 1000, f
    # the per-user artifact: one row per evaluated test user (max_users 3) and model (every cell, pretrained)
    per_user = pd.read_parquet(tmp_path / "results/summary/toy/users.parquet")
    assert len(per_user) == 3 * (len(cells) + 1) and per_user["user_id"].nunique() == 3
    for c in cells:
        chosen = read_json(tmp_path / c.run_dir / "metrics.json")["learning_rate"]
        scores = pd.read_parquet(tmp_path / c.run_dir / f"lr~{fmt_num(chosen)}" / "eval_users.parquet")
        assert scores["nll"].sum() / scores["n_tokens"].sum() == pytest.approx(
            read_json(tmp_path / c.run_dir / "metrics.json")["test_loss"])
    # nothing left to do on a second invocation
    again = snakemake(tmp_path, "--dry-run", "evaluation")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


def evaluation_targets(root: Path) -> list[str]:
    """The files `snakemake evaluation` promises, as listed by a dry run's summary."""
    res = snakemake(root, "--dry-run", "--summary", "evaluation")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return [line.split("\t")[0] for line in res.stdout.splitlines()[1:] if line.strip()]
