"""Private selection by random stopping in the pipeline (userdp.evaluation.random_stopping).

The number of runs K is drawn from the distribution dp-accounting's
RepeatAndSelectDpEvent accounts for; each run has its own seeds (its index
is part of them); only the best run is released, with the random-stopping
epsilon; K and the other runs are kept out of released artifacts under
secret seeds; a killed job resumes the same draw. A tiny real model runs
one cell end to end, and a Snakemake dry run checks the wiring.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from eval_builders import plan_record
from train_fixtures import make_tokenizer, tokens_table
from userdp import layout
from userdp.config import validate_config
from userdp.errors import DataError
from userdp.io import read_json, write_json
from userdp.privacy.selection import Selection

REPO = Path(__file__).resolve().parents[1]
SEQ = 12


# ---------------------------------------------------------------- the number of runs


@pytest.mark.parametrize("shape", [1.0, 0.0, 2.5])
@pytest.mark.parametrize("mean", [1.5, 3.0, 10.0])
def test_run_distribution_has_the_mean_the_accountant_assumes(shape, mean):
    """P[K = k] sums to one and its mean is mean_runs, with dp-accounting's gamma (so sampling == accounting)."""
    sel = Selection("random_stopping", 4, mean, shape)
    p = np.array(sel.run_probabilities(20000))
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert float((np.arange(1, len(p) + 1) * p).sum()) == pytest.approx(mean, rel=1e-6)
    if shape == 1.0:  # geometric: P[K = k] = gamma (1 - gamma)^(k - 1), gamma = 1 / mean
        g = 1 / mean
        assert p[:5] == pytest.approx([g * (1 - g) ** (k - 1) for k in range(1, 6)], rel=1e-9)


def test_draws_follow_the_distribution():
    sel = Selection("random_stopping", 3, 3.0, 1.0)
    rng = np.random.default_rng(7)
    ks = np.array([sel.draw_runs(rng.random()) for _ in range(40000)])
    p = np.array(sel.run_probabilities(6))
    freq = np.array([(ks == k).mean() for k in range(1, 7)])
    sd = np.sqrt(p * (1 - p) / len(ks))
    assert np.all(np.abs(freq - p) < 5 * sd), (freq, p)
    assert ks.min() == 1
    assert Selection("random_stopping", 3, 1.0, 1.0).draw_runs(0.999) == 1  # mean 1: exactly one run
    with pytest.raises(ValueError):
        sel.draw_runs(1.0)


def test_each_run_has_its_own_seeds():
    from userdp.training.run_seeds import run_seeds

    a, b = (run_seeds(0, 0, "d", "uls", "1", 100, 4, 0.01, trial=t) for t in (0, 1))
    assert a["sampler"] != b["sampler"] and a["noise"] != b["noise"]
    assert run_seeds(0, 0, "d", "uls", "1", 100, 4, 0.01) == run_seeds(0, 0, "d", "uls", "1", 100, 4, 0.01, trial=None)
    assert run_seeds(0, 0, "d", "uls", "1", 100, 4, 0.01, trial=0) == a


# ---------------------------------------------------------------- the job, with stand-in runs

CONFIG = {
    "seed": 0,
    "datasets": {"tiny": {"source": "synthetic", "split": {"validation": 0.2, "test": 0.1}}},
    "tokenizer": {"sequence_length": SEQ, "public_dataset": "tiny", "vocab_size": 300},
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2},
    "privacy": {"delta": 1e-6, "selection": {"accounting": "random_stopping", "mean_runs": 3.0}},
    "grid": {"datasets": ["tiny"], "methods": ["uls"], "epsilons": [2.0],
             "budgets": [{"compute": 600, "steps": 6}]},
    "training": {"learning_rates": [0.01, 0.03, 0.1], "physical_batch_size": 32, "threads": 1, "device": "cpu"},
    "evaluation": {"max_users": 20},
}
RS = {"accounting": "random_stopping", "candidates": 3, "mean_runs": 3.0, "shape": 1.0}
LOSS = {0.01: 3.0, 0.03: 2.5, 0.1: 2.8}  # stand-in validation loss per learning rate


def _config(**privacy):
    cfg = json.loads(json.dumps(CONFIG))
    cfg["privacy"].update(privacy)
    return validate_config(cfg)


def _ledger(trial_lr: float) -> dict:
    return {"method": "uls", "sampling_rate": 0.05, "noise_multiplier": 1.2, "clip_norm": 1.0, "group_size": 4,
            "delta": 1e-6, "steps_completed": 100, "epsilon": 1.0, "learning_rate": trial_lr, "selection": RS}


class StandIns:
    """train/evaluate of run_cell that write what a run writes and score by LOSS, recording their calls."""

    def __init__(self, fail_on_evaluation: int | None = None):
        self.trained: list[tuple[int, float]] = []
        self.evaluated = 0
        self.fail_on = fail_on_evaluation

    def train(self, job, trial, lr, run_dir):
        self.trained.append((trial, lr))
        (run_dir / "model").mkdir(parents=True)
        for name in layout.MODEL_FILES:
            (run_dir / "model" / name).write_text(f"trial {trial}")
        pq.write_table(__import__("pyarrow").table({"step": [0], "update_norm": [1.0]}), run_dir / layout.TRAIN_LOG)
        write_json(run_dir / layout.LEDGER, _ledger(lr) | {"seeds": {"torch": 12345 + trial, "noise": "secret"}})

    def evaluate(self, job, model_dir):
        self.evaluated += 1
        if self.fail_on is not None and self.evaluated == self.fail_on:
            raise RuntimeError("killed")
        lr = read_json(model_dir.parent / layout.LEDGER)["learning_rate"]
        return {"validation_loss": LOSS[lr], "test_loss": LOSS[lr] + 0.1, "test_n_users": 3}


def _job(tmp_path, cfg, dataset="tiny"):
    from userdp.evaluation.random_stopping import RandomStoppingJob

    plan = tmp_path / "plan.json"
    write_json(plan, plan_record("uls", 2.0, selection=Selection.from_record(RS)))
    return RandomStoppingJob(config=cfg, plan=str(plan), tokens="t", tokenizer="k", model="m",
                             cell_dir=str(tmp_path / "cell"), dataset=dataset, method="uls", eps="2", budget="600",
                             seed=0)


def _outs(tmp_path):
    cell = tmp_path / "cell"
    return dict(out_metrics=str(cell / "metrics.json"), out_ledger=str(cell / "ledger.json"),
                out_train_log=str(cell / "train_log.parquet"), out_model=str(cell / "model"))


def test_job_trains_k_runs_releases_the_best_and_deletes_the_rest(tmp_path):
    from userdp.evaluation import random_stopping as rs

    cfg = _config()
    stand = StandIns()
    metrics = rs.run_cell(_job(tmp_path, cfg), **_outs(tmp_path), train=stand.train, evaluate=stand.evaluate)
    ledger = read_json(tmp_path / "cell" / "ledger.json")
    k = ledger["random_stopping"]["runs"]  # derived seeds (synthetic dataset): K is recorded for research
    assert k == len(stand.trained) == len(metrics["learning_rate_sweep"]) >= 1
    # the draw is the seeded one the job derives, reproducible
    seed = rs.derive_seed(0, "tiny", "uls", "2", 600, 0, 0, "random_stopping")
    drawn = rs.draw(Selection.from_record(RS), CONFIG["training"]["learning_rates"], False, seed)
    assert [lr for _, lr in stand.trained] == drawn["learning_rates"] and k == drawn["runs"]
    assert [t for t, _ in stand.trained] == list(range(k))  # each run's index (its seeds) differs
    best_lr = min(drawn["learning_rates"], key=lambda lr: (LOSS[lr], lr))
    assert metrics["learning_rate"] == best_lr and metrics["validation_loss"] == LOSS[best_lr]
    chosen = ledger["random_stopping"]["chosen_run"]
    assert drawn["learning_rates"][chosen] == best_lr
    assert (tmp_path / "cell" / "model" / layout.MODEL_WEIGHTS).read_text() == f"trial {chosen}"
    # the released guarantee is the random-stopping bound of the run's event, not one run's epsilon
    sel = Selection.from_record(RS)
    from userdp.training.ledger import run_event

    expect = sel.epsilon(sel.released_event([run_event(_ledger(best_lr))]), 1e-6)
    assert ledger["epsilon"] == pytest.approx(expect, rel=1e-12) and ledger["epsilon"] > ledger["epsilon_one_run"]
    assert ledger["learning_rates_tried"] == 3 and "random number of runs" in ledger["epsilon_meaning"]
    assert not (tmp_path / "cell" / rs.STATE_DIR).exists()  # the draw and the other runs are gone


def test_secret_seeds_publish_neither_k_nor_the_other_runs(tmp_path):
    from userdp.evaluation import random_stopping as rs

    cfg = _config(secret_seeds=True)
    stand = StandIns()
    metrics = rs.run_cell(_job(tmp_path, cfg), **_outs(tmp_path), train=stand.train, evaluate=stand.evaluate)
    ledger = read_json(tmp_path / "cell" / "ledger.json")
    assert ledger["random_stopping"] == {"runs": "secret", "chosen_run": "secret"}
    assert metrics["learning_rate_sweep"] is None
    text = (tmp_path / "cell" / "ledger.json").read_text() + (tmp_path / "cell" / "metrics.json").read_text()
    assert "trial" not in text  # no run index leaks through a field name or value
    # the torch seed is derived from the run's index: published, it would tell which run was chosen
    assert ledger["seeds"]["torch"] == "withheld" and "1234" not in text
    assert not (tmp_path / "cell" / rs.STATE_DIR).exists()


def test_a_killed_job_resumes_the_same_draw_without_retraining_finished_runs(tmp_path):
    from userdp.evaluation import random_stopping as rs

    cfg = _config()
    # the first cell seed whose draw has at least 3 runs (a kill after the second scoring leaves one to do)
    cell_seed, k = next((s, k) for s in range(100) if (k := rs.draw(
        Selection.from_record(RS), CONFIG["training"]["learning_rates"], False,
        rs.derive_seed(0, "tiny", "uls", "2", 600, 0, s, "random_stopping"))["runs"]) >= 3)
    job = _job(tmp_path, cfg)
    job.seed = cell_seed
    first = StandIns(fail_on_evaluation=2)
    with pytest.raises(RuntimeError, match="killed"):
        rs.run_cell(job, **_outs(tmp_path), train=first.train, evaluate=first.evaluate)
    state_dir = tmp_path / "cell" / rs.STATE_DIR
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((state_dir / rs.STATE_FILE).stat().st_mode & 0o777) == "0o600"
    assert not (tmp_path / "cell" / "ledger.json").exists()
    second = StandIns()
    rs.run_cell(job, **_outs(tmp_path), train=second.train, evaluate=second.evaluate)
    # run 0 was done; run 1 trained but was not scored: it is complete, so it is scored, not retrained
    assert [t for t, _ in first.trained] == [0, 1]
    assert [t for t, _ in second.trained] == list(range(2, k))
    assert read_json(tmp_path / "cell" / "ledger.json")["random_stopping"]["runs"] == k


def test_the_job_refuses_a_plan_of_another_selection(tmp_path):
    from userdp.evaluation import random_stopping as rs

    job = _job(tmp_path, _config())
    write_json(job.plan, plan_record("uls", 2.0, selection=Selection("composed", 3)))
    with pytest.raises(DataError, match="calibrated for privacy.selection.accounting 'composed'"):
        rs.run_cell(job, **_outs(tmp_path), train=StandIns().train, evaluate=StandIns().evaluate)
    write_json(job.plan, plan_record("uls", 2.0, selection=Selection.from_record(dict(RS, candidates=2))))
    with pytest.raises(DataError, match="2 candidate learning rates, training.learning_rates has 3"):
        rs.run_cell(job, **_outs(tmp_path), train=StandIns().train, evaluate=StandIns().evaluate)


# ---------------------------------------------------------------- one cell, real model and accountant


@pytest.mark.integration
def test_one_cell_end_to_end_with_a_real_model(tmp_path):
    from userdp.evaluation import random_stopping as rs
    from userdp.privacy.planner import plan_cell, read_train_token_counts
    from userdp.training import models
    from userdp.training.ledger import run_event

    cfg = _config()
    vocab = make_tokenizer(tmp_path / "tokenizer")
    ids = models.special_ids(models.load_tokenizer(tmp_path / "tokenizer"))
    table = tokens_table(60, seed=3, vocab=vocab, max_len=SEQ)
    meta = {"vocab_size": vocab, **ids, "sequence_length": SEQ, "long_examples": "truncate"}
    tokens = tmp_path / "tokens.parquet"
    pq.write_table(table.replace_schema_metadata({"userdp": json.dumps(meta)}), tokens)
    models.build_model(cfg["model"], vocab, SEQ, ids, seed=0).save_pretrained(tmp_path / "base")
    sel = Selection.from_config(cfg["privacy"], cfg["training"]["learning_rates"])
    plan = plan_cell(dataset="tiny", method="uls", epsilon=2.0, compute_budget=600, steps=6,
                     counts=read_train_token_counts(str(tokens)), privacy=cfg["privacy"], selection=sel)
    assert plan.selection.record() == RS
    plan.write(tmp_path / "plan.json")
    job = rs.RandomStoppingJob(config=cfg, plan=str(tmp_path / "plan.json"), tokens=str(tokens),
                               tokenizer=str(tmp_path / "tokenizer"), model=str(tmp_path / "base"),
                               cell_dir=str(tmp_path / "cell"), dataset="tiny", method="uls", eps="2",
                               budget="600", seed=0)
    metrics = rs.run_cell(job, **_outs(tmp_path))
    ledger = read_json(tmp_path / "cell" / "ledger.json")
    assert ledger["epsilon"] <= 2.0 * (1 + cfg["privacy"]["calibration_tolerance"])
    assert ledger["epsilon"] == pytest.approx(sel.epsilon(sel.released_event([run_event(ledger)]), 1e-6), rel=1e-9)
    assert ledger["epsilon_one_run"] < ledger["epsilon"]
    assert math.isfinite(metrics["test_loss"]) and metrics["learning_rate"] in cfg["training"]["learning_rates"]
    released = models.load_model(str(tmp_path / "cell" / "model"))
    assert sum(p.numel() for p in released.parameters()) > 0
    assert not (tmp_path / "cell" / rs.STATE_DIR).exists()
    assert len(metrics["learning_rate_sweep"]) == ledger["random_stopping"]["runs"]


@pytest.mark.integration
def test_dry_run_schedules_one_job_per_private_cell_and_no_learning_rate_runs(tmp_path):
    cfg = tmp_path / "rs.yaml"
    cfg.write_text("privacy:\n  selection: {accounting: random_stopping, mean_runs: 2}\n"
                   "training:\n  learning_rates: [0.001, 0.003]\n"
                   "grid:\n  group_size_sweep: []\n  budgets: [{compute: 8000, steps: 50}]\n")
    res = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet", "rules", "--directory", str(tmp_path),
                          "-s", str(REPO / "Snakefile"), "--configfile", str(REPO / "config" / "config.yaml"), str(cfg)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    counts = {line.split()[0]: int(line.split()[1]) for line in res.stdout.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    # the default grid at one budget: 2 methods x 2 finite epsilons private cells, 2 eps~inf references with 2 rates
    # each (one finetune job per reference cell trains both)
    assert counts["random_stopping"] == 4, res.stdout
    assert counts["select_lr"] == 2 and counts["finetune"] == 2 and "evaluate" not in counts, res.stdout
    assert "finetune_group" not in counts
