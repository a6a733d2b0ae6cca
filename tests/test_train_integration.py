"""The training rules (pretrain + finetune) in a real snakemake run on a tiny config.

The data and plan stages are stood in for by hand-built inputs (tokenizer,
tokens, public tokens, plans with epsilon from the real accountant: fixture
train_stage in conftest.py), and a Snakefile in the temp dir includes only
common.smk and train.smk, so this test exercises exactly the training stage.
"""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from userdp.io import read_json
from userdp.layout import fmt_num
from userdp.grid import iter_cells


@pytest.mark.integration
def test_pretrain_and_finetune_end_to_end(train_stage, tmp_path):
    cfg, raw = train_stage.config, train_stage.raw
    rates = [0.001, 0.01]  # one finetune job per cell trains both, one after the other
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump({**raw, "training": {**raw["training"],
                                                                              "learning_rates": rates}}))
    res = train_stage.snakemake()
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "results/model/pretrained/model.safetensors").exists()
    pretrain_log = (tmp_path / "results/logs/pretrain.log").read_text()
    assert "pretrain steps (batch " in pretrain_log and ": 20/20 (100.0%)" in pretrain_log
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
    again = train_stage.snakemake("--dry-run")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
