"""The fine-tuning job's entry (finetune_job.run_job): a rerun starts from a run folder without stale files."""

from __future__ import annotations

import pytest

from userdp.errors import DataError
from userdp.training import finetune_job


def test_a_failed_rerun_leaves_no_files_of_the_earlier_model(tmp_path):
    """snakemake deleted the declared outputs (weights, config.json, ledger, log); what else the old model left
    (generation_config.json) and the old model's eval.json go before anything can fail."""
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "generation_config.json").write_text("{}")
    (run / "eval.json").write_text('{"test_loss": 1.0}')
    (run / "notes.txt").write_text("mine")  # not the pipeline's: kept
    job = finetune_job.FinetuneJob(
        config={"seed": 0}, plan=str(tmp_path / "missing_plan.json"), tokens="t", tokenizer="k",
        model="m", run_dir=str(run), learning_rate=1e-3, dataset="d", method="els", eps="1", budget="100",
        seed=0, threads=1)
    with pytest.raises(DataError, match=r"missing_plan\.json does not exist; rerun snakemake"):
        finetune_job.run_job(job)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_an_empty_model_folder_snakemake_made_is_not_reported_stale(tmp_path, caplog):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    with caplog.at_level("INFO"):
        finetune_job.clear_stale_outputs(run)
    assert (run / "model").is_dir() and "removed" not in caplog.text
