"""workflow/scripts/finetune.py, run as Snakemake runs it (a `snakemake` object in its globals), with the training
and the evaluation replaced by recorders: rule finetune evaluates every run it trains on the held-out users of
its `evaluation` param; rule audit_finetune (`audit` param, no `evaluation`) trains only (its runs are scored on their
canaries by rule audit_score, so no eval.json is written beside them), with the audit's own seeds."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import yaml

from userdp.config import validate_config
from userdp.evaluation import metrics
from userdp.evaluation.targets import evaluation_params
from userdp.training import finetune_job
from userdp.training.targets import finetune_params

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "workflow" / "scripts" / "finetune.py"


class _Wildcards(SimpleNamespace):
    def get(self, name, default=None):
        return getattr(self, name, default)


def _run_script(tmp_path, monkeypatch, **params):
    config = validate_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    rates = [float(lr) for lr in config["training"]["learning_rates"]]
    runs = [str(tmp_path / f"lr~{lr:g}") for lr in rates]
    trained, evaluated = [], []
    monkeypatch.setattr(finetune_job, "launch_sweep", lambda jobs, processes: trained.extend(jobs))
    monkeypatch.setattr(metrics, "evaluate_runs", lambda runs, tokens, **kw: evaluated.append((runs, tokens, kw)))
    sm = SimpleNamespace(
        log=[str(tmp_path / "job.log")],
        params=SimpleNamespace(settings=finetune_params(config, "synth"), learning_rates=rates, model="base",
                               **{k: v(config) if callable(v) else v for k, v in params.items()}),
        config=config,
        wildcards=_Wildcards(dataset="synth", method="uls", eps="1", budget="2000", seed="0"),
        output=[f"{run}/ledger.json" for run in runs],
        input=SimpleNamespace(plan="plan.json", tokens="tokens.parquet", tokenizer="tokenizer.json"),
        threads=1,
        resources=SimpleNamespace(gpu=0),
    )
    runpy.run_path(str(SCRIPT), init_globals={"snakemake": sm})
    return runs, trained, evaluated


def test_rule_finetune_trains_then_evaluates_every_run(tmp_path, monkeypatch):
    runs, trained, evaluated = _run_script(tmp_path, monkeypatch, evaluation=evaluation_params)
    assert [j.run_dir for j in trained] == runs and not any(j.audit for j in trained)
    ((rate_runs, tokens, kw),) = evaluated
    assert [run for _, run in rate_runs] == runs and tokens == "tokens.parquet"
    assert kw["dataset"] == "synth" and kw["max_users"] == 300 and kw["root_seed"] == 0


def test_rule_audit_finetune_trains_only(tmp_path, monkeypatch):
    runs, trained, evaluated = _run_script(tmp_path, monkeypatch, audit=True)
    assert [j.run_dir for j in trained] == runs and evaluated == []
    assert all(j.audit for j in trained)  # its own seeds (training.run_seeds)


def test_the_audit_rule_passes_no_evaluation():
    """audit.smk's audit_finetune replaces finetune's params with its shared ones (common.smk: FINETUNE_PARAMS)
    and `audit=True` (the script's switch: the runs' own seeds, no evaluation), nothing else."""
    text = (REPO / "workflow" / "rules" / "audit.smk").read_text()
    block = text[text.index("use rule finetune as audit_finetune"):text.index("rule audit_score:")]
    params = block[block.index("    params:\n"):block.index("    wildcard_constraints:")]
    lines = [ln.strip() for ln in params.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines == ["params:", "**FINETUNE_PARAMS,", "audit=True,"]


def test_the_audit_rule_requests_one_training_run_not_finetunes_evaluations():
    """audit_finetune trains one run and evaluates none: it requests resources.finetune_mem_mb and
    resources.finetune_runtime, not finetune's max(finetune, evaluation.mem_mb) and (training + evaluation) minutes
    per learning rate (which `use rule` would inherit)."""
    text = (REPO / "workflow" / "rules" / "audit.smk").read_text()
    block = text[text.index("use rule finetune as audit_finetune"):text.index("rule audit_score:")]
    resources = block[block.index("    resources:\n"):block.index("    log:")]
    lines = [ln.strip() for ln in resources.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines == ["resources:", 'mem_mb=config["resources"]["finetune_mem_mb"],',
                     'runtime=config["resources"]["finetune_runtime"],', 'gpu=config["training"]["gpus"],',
                     'cpus_per_gpu=config["training"]["threads"],']
