"""One fine-tuning job trains every learning rate of a cell (finetune_job.launch_sweep): each run is the run alone.

The rates share a process (one start-up), not state: a run trained second in a job has the same weights,
ledger and per-step log as the same run trained on its own, so batching the sweep changes no released model
and no mechanism (each rate draws its own samples and noise from its own seeds, run_seeds.run_seeds).
"""

from __future__ import annotations

import os
import shutil
import signal

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from userdp.config import validate_config
from userdp.errors import Preempted
from userdp.io import read_json
from userdp.layout import PRETRAINED, fmt_num
from userdp.grid import iter_cells
from userdp.training import engine, finetune_job
from userdp.training.models import build_model, load_tokenizer, special_ids, save_model_atomic
from userdp.training.targets import rates_per_job, sweep_runs

RATES = (0.001, 0.01)


def _inputs(stage):
    root, cfg = stage.root, stage.raw
    cfg["training"]["learning_rates"] = list(RATES)
    cfg = validate_config(cfg)
    tokenizer = load_tokenizer(str(root / "results/tokenizer"))
    model = build_model(cfg["model"], len(tokenizer), cfg["tokenizer"]["sequence_length"],
                        special_ids(tokenizer), seed=0)
    save_model_atomic(model, root / PRETRAINED)
    return cfg


def _job(root, cfg, cell, lr, run_dir):
    return finetune_job.FinetuneJob(
        config=cfg, plan=str(root / cell.plan_path), tokens=str(root / "results/data/tiny/tokens.parquet"),
        tokenizer=str(root / "results/tokenizer"), model=str(root / PRETRAINED), run_dir=str(run_dir),
        learning_rate=lr, dataset=cell.dataset, method=cell.method, eps=cell.eps_text, budget=str(cell.compute),
        seed=cell.seed, threads=1)


def _ledger(run_dir):
    return read_json(run_dir / "ledger.json")


@pytest.mark.integration
def test_a_run_trained_after_another_rate_in_one_job_equals_the_run_alone(train_stage, tmp_path, monkeypatch,
                                                                          caplog):
    monkeypatch.chdir(tmp_path)  # the plans' and finished records' relative paths
    cfg = _inputs(train_stage)
    for cell in iter_cells(cfg):
        swept = [tmp_path / "sweep" / cell.lr_dir(lr) for lr in RATES]
        alone = tmp_path / "alone" / cell.lr_dir(RATES[1])
        finetune_job.launch_sweep([_job(tmp_path, cfg, cell, lr, d) for lr, d in zip(RATES, swept)], processes=0)
        finetune_job.launch(_job(tmp_path, cfg, cell, RATES[1], alone), processes=0)

        first, second, ref = (load_file(d / "model/model.safetensors") for d in (*swept, alone))
        assert second.keys() == ref.keys()
        assert all(torch.equal(second[k], ref[k]) for k in ref), f"{cell.method}: the second rate's model differs"
        assert any(not torch.equal(first[k], second[k]) for k in ref)  # the rates did train different models
        assert _ledger(swept[1]) == _ledger(alone)
        assert _ledger(swept[1])["learning_rate"] == RATES[1] and _ledger(swept[0])["learning_rate"] == RATES[0]
        pd.testing.assert_frame_equal(pd.read_parquet(swept[1] / "train_log.parquet"),
                                      pd.read_parquet(alone / "train_log.parquet"))

        # The job is rerun after snakemake deleted its outputs (a kill after both rates finished): each rate is
        # restored from its own finished/ record, bit for bit, none trains again.
        before = [(d / "model/model.safetensors").read_bytes() for d in swept]
        for d in swept:
            shutil.rmtree(d / "model")
            (d / "ledger.json").unlink()
            (d / "train_log.parquet").unlink()
        caplog.clear()
        with caplog.at_level("INFO"):
            finetune_job.launch_sweep([_job(tmp_path, cfg, cell, lr, d) for lr, d in zip(RATES, swept)], 0)
        assert caplog.text.count("restored the finished outputs") == 2 and "run complete" not in caplog.text
        assert [(d / "model/model.safetensors").read_bytes() for d in swept] == before


def test_a_job_finds_its_runs_in_its_outputs_every_rate_or_one():
    """The rule's outputs per job (every rate's run folder, or one per run: tests/test_rules.py) give the job its
    runs, in order, each with its rate."""
    rates = [0.001, 3e-4]
    dirs = [f"results/runs/d/method~els/seed~0/lr~{fmt_num(lr)}" for lr in rates]
    outputs = [f"{d}/{name}" for d in dirs for name in ("ledger.json", "train_log.parquet", "model/config.json",
                                                          "model/model.safetensors", "eval.json", "eval_users.parquet")]
    assert sweep_runs(outputs, "ledger.json", rates) == list(zip(rates, dirs))
    assert sweep_runs(outputs[6:], "ledger.json", rates) == [(3e-4, dirs[1])]
    assert rates_per_job({"training": {"learning_rates": rates}}) == 2
    assert rates_per_job({"training": {"learning_rates": rates, "sweep_jobs": "per_run"}}) == 1
    with pytest.raises(ValueError, match="lr~0.5"):
        sweep_runs(["results/runs/d/x/lr~0.5/eval.json"], "eval.json", rates)


def test_a_sigterm_while_a_rate_finishes_stops_the_job_before_the_next_rate(monkeypatch):
    """SLURM's preemption signal in the last step of a run: the run completes, the next rate never starts (exit
    143: the rerun restores the finished run and trains the rest) instead of training on until SIGKILL."""
    caught = []
    previous = signal.signal(signal.SIGTERM, lambda *_: caught.append(1))  # the test process must survive
    started = []

    def fake_launch(job, processes):  # a run that completes although SIGTERM arrived while it trained
        started.append(job.learning_rate)
        with engine.StopOnSigterm(enabled=True) as run_stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert run_stop.requested

    monkeypatch.setattr(finetune_job, "launch", fake_launch)
    jobs = [finetune_job.FinetuneJob(config={}, plan="p", tokens="t", tokenizer="k", model="m", run_dir=f"r{lr}",
                                     learning_rate=lr, dataset="d", method="els", eps="1", budget="8", seed=0)
            for lr in RATES]
    try:
        with pytest.raises(Preempted):  # the job's run_main exits 128 + SIGTERM on it
            finetune_job.launch_sweep(jobs, processes=0)
        assert started == [RATES[0]]  # the second rate never started
        # a single run keeps the engine's own behaviour (a run that completed ends the job normally); the
        # process's own handler is not called while a run holds SIGTERM (it would stop the step in progress)
        started.clear()
        finetune_job.launch_sweep(jobs[:1], processes=0)
        assert started == [RATES[0]] and not caught
    finally:
        signal.signal(signal.SIGTERM, previous)
