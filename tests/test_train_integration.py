"""The training rules (pretrain + finetune) in a real snakemake run on a tiny config.

The data and plan stages are stood in for by hand-built inputs (tokenizer,
tokens, public tokens, plans with epsilon from the real accountant), and a
Snakefile in the temp dir includes only common.smk and train.smk, so this
test exercises exactly the training stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from train_fixtures import make_tokenizer, public_tokens_table, tokens_table
from userdp.config import validate_config
from userdp.layout import fmt_num, iter_cells
from userdp.io import read_json, write_json

REPO = Path(__file__).resolve().parents[1]
SEQ = 12

CONFIG = {
    "seed": 0,
    "datasets": {"tiny": {"source": "synthetic", "split": {"validation": 0.2, "test": 0.1}}},
    "tokenizer": {"sequence_length": SEQ, "public_dataset": "tiny", "vocab_size": 300},
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "pretrain": {"steps": 20, "batch_size": 8}},
    "grid": {"datasets": ["tiny"], "methods": ["els", "uls"], "epsilons": [8], "nonprivate": False,
             "budgets": [{"compute": 24, "steps": 3}], "seeds": [0]},
    "training": {"learning_rates": [0.001], "physical_batch_size": 4, "checkpoint_every": 2, "threads": 1,
                 "device": "cpu"},
}


def build_inputs(root: Path) -> dict:
    from privacy_helpers import epsilon_of
    from userdp.privacy.spec import RunSpec
    from userdp.training.pool import build_pool

    cfg = validate_config(json.loads(json.dumps(CONFIG)))
    vocab = make_tokenizer(root / "results/tokenizer")
    tokens = tokens_table(40, seed=5, vocab=vocab, max_len=SEQ)
    (root / "results/data/tiny").mkdir(parents=True, exist_ok=True)
    pq.write_table(tokens, root / "results/data/tiny/tokens.parquet")
    pq.write_table(public_tokens_table(vocab, n=100), root / "results/data/tiny/public_tokens.parquet")
    train = tokens.filter(tokens["split"].to_pandas().eq("train").to_numpy())
    for cell in iter_cells(cfg):
        G = 2 if cell.method == "els" else 3
        pool = build_pool(train.select(["user_id", "example_id", "input_ids"]), G, seed=0)
        n = pool.n_examples if cell.method == "els" else pool.n_users
        expected = 4.0 if cell.method == "els" else 2.0
        q, sigma, delta = expected / n, 1.0, 1e-3
        RunSpec(
            dataset=cell.dataset, method=cell.method, epsilon=cell.epsilon, delta=delta, group_size=G,
            sampling_rate=q, steps=cell.steps, expected_batch=expected, noise_multiplier=sigma,
            epsilon_achieved=epsilon_of(cell.method, sigma, q, cell.steps, delta,
                                        group_size=G if cell.method == "els" else 1),
            compute_budget=cell.compute, accountant="pld", group_size_rule="explicit", clip_norm=1.0, clipping="flat",
        ).write(root / cell.plan_path)
    (root / "extra.yaml").write_text(yaml.safe_dump(CONFIG))
    (root / "Snakefile").write_text(
        f'include: "{REPO}/workflow/rules/common.smk"\n'
        f'include: "{REPO}/workflow/rules/train.smk"\n\n'
        "from userdp.training.targets import train_targets\n\n\n"
        "rule all:\n    input:\n        train_targets(config),\n    default_target: True\n"
    )
    return cfg


def snakemake(root: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "--directory", str(root),
           "--configfile", str(root / "extra.yaml"), "--cores", "2", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.integration
def test_pretrain_and_finetune_end_to_end(tmp_path):
    cfg = build_inputs(tmp_path)
    rates = [0.001, 0.01]  # one finetune job per cell trains both, one after the other
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump({**CONFIG, "training": {**CONFIG["training"],
                                                                                 "learning_rates": rates}}))
    res = snakemake(tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "results/model/pretrained/model.safetensors").exists()
    assert "pretrain step 20/20" in (tmp_path / "results/logs/pretrain.log").read_text()
    assert res.stdout.count("rule finetune:") + res.stderr.count("rule finetune:") == 2  # one job per cell
    for cell in iter_cells(cfg):
        plan = read_json(tmp_path / cell.plan_path)
        for lr in rates:
            run = tmp_path / cell.run_dir / f"lr~{fmt_num(lr)}"
            ledger = read_json(run / "ledger.json")
            assert ledger["method"] == cell.method and ledger["complete"]
            assert ledger["steps_completed"] == plan["steps"] == 3
            assert ledger["epsilon"] == pytest.approx(plan["epsilon_achieved"], rel=1e-9)
            assert ledger["learning_rate"] == lr
            log = pd.read_parquet(run / "train_log.parquet")
            assert log["step"].tolist() == [1, 2, 3]
            assert "loss" not in log.columns and "examples_processed" not in log.columns  # debug_step_log off
            assert (run / "model/model.safetensors").exists() and (run / "model/config.json").exists()
            assert not (run / "checkpoint").exists()
        logfile = tmp_path / "results/logs/finetune/tiny" / f"method~{cell.method}/eps~8/budget~24/seed~0.log"
        text = logfile.read_text()
        assert text.count("run complete: 3 steps") == 2 and "learning rate 2/2: 0.01" in text
    # nothing left to do
    again = snakemake(tmp_path, "--dry-run")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
