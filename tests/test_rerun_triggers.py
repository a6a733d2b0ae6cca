"""Which rules a config change reruns, checked with the real `snakemake`.

The whole DAG of tests/configs/tiny.yaml (plus a G sweep, so rule
finetune_group exists) is faked cheaply: every output is created empty and
`snakemake --touch --forceall` runs each job in touch mode, which records the
job's params and inputs in .snakemake/metadata exactly as a real run would.
Then `snakemake -n` with one config key changed must plan exactly the rules
whose params carry that key (and what depends on their outputs), and nothing
for keys that change no result (threads, batch sizes, checkpointing).

The scripts read the config only through userdp.untracked.untracked
(tests/test_structure.py), for the keys that change no result, which are no
params and so no rerun trigger; the jobs rebuild the config sections they
read from their params and those keys (checked against the whole config
below).

Two fast checks back the "changes no result" claims the workflow relies on:
fine-tuning with another training.physical_batch_size gives the same model,
and the plan built from a cell's filtered privacy params is the plan built
from the whole privacy config (tests/test_eval_metrics.py does the same for
evaluation.batch_size).
"""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "configs" / "tiny.yaml"

# Rules downstream of a fine-tuning run (what a training change must rerun).
AFTER_FINETUNE = {
    "finetune", "finetune_group", "select_lr", "aggregate",
    "plot_lm_loss_vs_budget", "plot_lm_loss_vs_epsilon", "plot_lm_loss_vs_group_size", "plot_training_curves",
    "plot_lm_uls_minus_els", "findings", "groups", "plot_groups_cost", "plot_groups_gap_vs_examples",
}
# Rules downstream of the per-user scores (rule groups: the cost of privacy per user group).
AFTER_GROUPS = {"groups", "plot_groups_cost", "plot_groups_gap_vs_examples", "findings"}


def base_config() -> dict:
    config = yaml.safe_load(TINY.read_text())
    config["grid"]["group_size_sweep"] = [2]  # G-sweep cells: rules plan_group_sweep and finetune_group
    return config


def snakemake(workdir: Path, configfile: Path, *args: str, timeout: int = 300) -> str:
    cmd = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
        "--configfile", str(configfile), "--replace-workflow-config", "--cores", "2", "--nolock", *args,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(args)} failed (rc {p.returncode}):\n{out[-5000:]}"
    return out


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def dry_run(workdir: Path, config: dict, name: str) -> tuple[dict[str, int], set[str]]:
    """(jobs per rule, output files of those jobs) that `snakemake -n` plans for `config`."""
    out = snakemake(workdir, write_config(workdir / f"{name}.yaml", config), "-n")
    if "Nothing to be done" in out:
        return {}, set()
    table = out[out.index("Job stats:"):]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table.split("\n\n")[0], re.M)}
    jobs.pop("total", None)
    jobs.pop("all", None)
    outputs = set()
    for m in re.finditer(r"^    output: (.*)$", out, re.M):
        outputs.update(s.strip() for s in m.group(1).split(","))
    return jobs, outputs


def changed(**changes) -> dict:
    """base_config() with dotted keys set, e.g. changed(**{"training.optimizer": "sgd"})."""
    config = base_config()
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config


def reversed_keys(value):
    """`value` with every mapping's keys in reverse order (the same config, written differently)."""
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    return value


SCENARIOS = {
    # keys that change no result, in a file with every key order reversed: nothing reruns
    "no_result_keys": reversed_keys(changed(**{
        "training.threads": 2, "training.checkpoint_every": 3, "training.physical_batch_size": 128,
        "training.gradient_checkpointing": True,
        "evaluation.batch_size": 7, "evaluation.mem_mb": 3000, "tokenizer.batch_rows": 50, "tokenizer.threads": 1,
        "resources.finetune_mem_mb": 3000,
        "training.sweep_jobs": "per_run",  # a job per run instead of per cell: the same runs
        # explicit false resolves to what null gives a synthetic dataset: the same params
        "privacy.secret_seeds": False,
    })),
    "secret_seeds": changed(**{"privacy.secret_seeds": True}),
    "debug_step_log": changed(**{"training.debug_step_log": True}),
    "optimizer": changed(**{"training.optimizer": "sgd"}),
    "device": changed(**{"training.device": "cpu"}),
    "model": changed(**{"model.n_layer": 2}),
    "pretrain": changed(**{"model.pretrain.steps": 41}),
    "comparison": changed(**{"privacy.comparison.steps": 21}),
    "uls_group_rule": changed(**{"privacy.group_size.uls": 2}),
    "add_epsilon": changed(**{"grid.epsilons": [4, 8]}),
    # composed (default): the number of learning rates is part of every plan (each run is calibrated for k runs)
    "more_learning_rates": changed(**{"training.learning_rates": [0.003, 0.01]}),
    "selection_per_run": changed(**{"privacy.selection.accounting": "per_run"}),
    # a study key no calibration reads (the calibration job gets it untracked): the study reruns, not its calibration
    "mean_estimation_dimension": changed(**{"mean_estimation.dimension": 4}),
    # one learning rate: validation users are scored only when asked for
    "validation_always": changed(**{"evaluation.validation": "always"}),
    # the cost-of-privacy table's settings: only the table, its figures and the findings
    "groups_settings": changed(**{"groups.min_users": 3, "groups.bootstrap": 500, "groups.size_edges": [1, 4]}),
    # whether the scatter draws per-user points: only that figure
    "per_user_points": changed(**{"groups.per_user_points": "never"}),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Fake a finished run of the base config, then dry-run every scenario (in parallel: mostly waiting)."""
    workdir = tmp_path_factory.mktemp("rerun")
    base = write_config(workdir / "base.yaml", base_config())
    summary = snakemake(workdir, base, "--summary")
    for line in summary.splitlines():
        cols = line.split("\t")
        if len(cols) >= 5 and cols[4] == "missing":
            f = workdir / cols[0]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.touch()
    snakemake(workdir, base, "--touch", "--forceall")
    names = ["baseline", *SCENARIOS]
    configs = [base_config(), *SCENARIOS.values()]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda nc: dry_run(workdir, nc[1], nc[0]), zip(names, configs)))
    return dict(zip(names, results))


@pytest.mark.integration
def test_scoring_validation_users_reruns_evaluation_not_planning(plans):
    """The fine-tuning jobs evaluate their runs, so they rerun (restoring each finished run from its finished/
    record, tests/test_train_finished.py, and scoring it again); no plan and no pretraining reruns."""
    jobs, _ = plans["validation_always"]
    assert jobs["finetune"] == 4 and jobs["finetune_group"] == 2 and jobs["evaluate_pretrained"] == 1, jobs
    assert not {"plan", "plan_group_sweep", "pretrain"} & set(jobs), jobs


@pytest.mark.integration
def test_touched_pipeline_is_up_to_date(plans):
    assert plans["baseline"] == ({}, set())


@pytest.mark.integration
def test_keys_that_change_no_result_rerun_nothing(plans):
    assert plans["no_result_keys"] == ({}, set())


@pytest.mark.integration
def test_optimizer_reruns_every_finetune_and_only_what_follows(plans):
    jobs, _ = plans["optimizer"]
    assert set(jobs) == AFTER_FINETUNE
    assert jobs["finetune"] == 4 and jobs["finetune_group"] == 2


@pytest.mark.integration
def test_device_reruns_training_but_not_evaluation_of_the_pretrained_model(plans):
    jobs, _ = plans["device"]
    assert set(jobs) == AFTER_FINETUNE


@pytest.mark.integration
@pytest.mark.parametrize("scenario", ["model", "pretrain"])
def test_model_keys_rerun_pretraining_and_training(plans, scenario):
    jobs, _ = plans[scenario]
    assert set(jobs) == AFTER_FINETUNE | {"pretrain", "evaluate_pretrained"}


@pytest.mark.integration
def test_secret_seeds_rerun_the_runs_whose_resolved_value_changes(plans):
    """tiny.yaml's dataset is synthetic (null resolves to derived): true reruns its runs, false (above) nothing."""
    jobs, _ = plans["secret_seeds"]
    assert set(jobs) == AFTER_FINETUNE
    assert jobs["finetune"] == 4 and jobs["finetune_group"] == 2


@pytest.mark.integration
def test_debug_step_log_reruns_training_and_the_cells_logs(plans):
    jobs, _ = plans["debug_step_log"]
    assert set(jobs) == AFTER_FINETUNE and jobs["select_lr"] >= 1


@pytest.mark.integration
def test_group_settings_rerun_only_the_group_table_and_what_reads_it(plans):
    jobs, _ = plans["groups_settings"]
    assert set(jobs) == AFTER_GROUPS
    jobs, _ = plans["per_user_points"]
    assert set(jobs) == {"plot_groups_gap_vs_examples"}


@pytest.mark.integration
def test_comparison_reruns_only_the_comparison(plans):
    jobs, _ = plans["comparison"]
    assert set(jobs) == {"accounting_comparison", "plot_noise_vs_group_size", "findings"}  # claim 5 reads it


@pytest.mark.integration
def test_group_size_rule_of_one_method_replans_only_that_method(plans):
    jobs, outputs = plans["uls_group_rule"]
    planned = {o for o in outputs if o.startswith("results/plan/")}
    assert planned == {f"results/plan/tiny/method~uls/eps~{e}/budget~960.json" for e in ("4", "inf")}
    assert jobs["finetune"] == 2 and "finetune_group" not in jobs


@pytest.mark.integration
def test_adding_an_epsilon_leaves_existing_cells_alone(plans):
    jobs, outputs = plans["add_epsilon"]
    planned = {o for o in outputs if o.startswith("results/plan/")}
    # New cells at eps 8; the ULS reference (eps~inf, SNR rule) chooses G at the
    # largest grid epsilon, which changed, so it alone of the old cells is re-planned.
    assert planned == {
        "results/plan/tiny/method~els/eps~8/budget~960.json",
        "results/plan/tiny/method~uls/eps~8/budget~960.json",
        "results/plan/tiny/method~uls/eps~inf/budget~960.json",
    }
    assert not [o for o in outputs if "/eps~4/" in o or "method~els/eps~inf" in o]
    assert "plan_group_sweep" not in jobs and "finetune_group" not in jobs
    assert jobs["finetune"] == 3


@pytest.mark.integration
def test_the_number_of_learning_rates_replans_every_cell_in_composed_mode(plans):
    jobs, outputs = plans["more_learning_rates"]
    assert jobs["plan"] == 4 and jobs["plan_group_sweep"] == 2
    # the old rate's runs retrain (their plans changed) and the new rate's are added: one job per cell trains both
    assert jobs["finetune"] == 4 and jobs["finetune_group"] == 2
    for lr in ("0.003", "0.01"):
        assert len([o for o in outputs if o.endswith(f"/lr~{lr}/ledger.json")]) == 6, outputs


@pytest.mark.integration
def test_a_study_key_reruns_the_study_but_not_its_calibration(plans):
    jobs, _ = plans["mean_estimation_dimension"]
    assert "mean_estimation" in jobs and "mean_estimation_calibration" not in jobs
    assert set(jobs) <= {"mean_estimation", "findings"} | {r for r in jobs if r.startswith("plot_mean_estimation")}


@pytest.mark.integration
def test_switching_the_selection_accounting_replans_every_cell(plans):
    jobs, _ = plans["selection_per_run"]
    assert jobs["plan"] == 4 and jobs["plan_group_sweep"] == 2 and jobs["finetune"] == 4


# --- the claims behind the choice of params -----------------------------------


def test_physical_batch_size_does_not_change_the_trained_model(tmp_path):
    """Micro-batching sums the same clipped per-unit gradients in another order (so: not a param)."""
    from train_fixtures import SEQ, plan_for, tiny_model, tokens_table

    from userdp.training import engine, run_seeds, run_state
    from userdp.training.pool import build_pool
    from userdp.training.settings import TrainSettings

    t = tokens_table(40, seed=3)
    pool = build_pool(t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"]), 3, seed=0)
    fake_eps = lambda *a, **k: 1.0  # noqa: E731 (epsilon's value is not under test)
    for method in ("els", "uls"):
        params = []
        for pbs in (3, 64):
            model = tiny_model()
            settings = TrainSettings(learning_rate=1e-2, physical_batch_size=pbs, sequence_length=SEQ,
                                     checkpoint_every=100, device="cpu", log_every_s=1e9)
            plan = plan_for(pool, method, expected=6.0, steps=3, sigma=0.5, clip=1.0)
            engine.train(model, pool, plan, settings, run_state.RunPaths(tmp_path / f"{method}{pbs}"),
                         run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, 3), 0, compute_epsilon=fake_eps)
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        assert torch.allclose(params[0], params[1], rtol=1e-4, atol=1e-6), method


@pytest.mark.integration
def test_filtered_privacy_params_give_the_same_plans():
    """plan_cell on a cell's params equals plan_cell on the whole privacy config, for every kind of cell."""
    from userdp.config import validate_config
    from userdp.privacy.planner import plan_cell
    from userdp.privacy.targets import plan_privacy_params, reference_epsilon_param

    config = validate_config(copy.deepcopy(base_config()))
    config["grid"]["epsilons"] = [2, 4]
    rng = np.random.default_rng(0)
    counts = np.clip(np.round(np.exp(rng.normal(np.log(4), 1.0, 400))), 1, 64).astype(int)
    for method, eps, group in [("els", "4", None), ("uls", "4", None), ("els", "inf", None), ("uls", "inf", None),
                               ("uls", "4", "2"), ("els", "inf", "2")]:
        kw = dict(dataset="tiny", method=method, epsilon=math.inf if eps == "inf" else float(eps),
                  compute_budget=960, steps=12, counts=counts, group_size=None if group is None else int(group))
        full = plan_cell(privacy=config["privacy"], reference_epsilon=4.0, **kw)
        mine = plan_cell(privacy=plan_privacy_params(config, method, eps, group),
                         reference_epsilon=reference_epsilon_param(config, method, eps, group), **kw)
        assert mine.without_timing() == full.without_timing(), (method, eps, group)
    assert reference_epsilon_param(config, "els", "inf") is None  # median rule: G does not depend on epsilon
    assert reference_epsilon_param(config, "uls", "inf") == 4.0
    assert "comparison" not in plan_privacy_params(config, "uls", "4")


# --- the untracked param and the jobs' configs rebuilt from params --------------------------------------------


def test_untracked_copies_the_keys_nested_and_names_a_missing_one():
    from userdp.config import validate_config
    from userdp.untracked import untracked

    config = validate_config(base_config())
    value = untracked(config, "tokenizer.batch_rows", "training.physical_batch_size")
    assert value == {"tokenizer": {"batch_rows": config["tokenizer"]["batch_rows"]},
                     "training": {"physical_batch_size": 64}}
    section = untracked(config, "mean_estimation")["mean_estimation"]
    section["n_users"] = -1  # a copy: the job cannot change the config
    assert config["mean_estimation"]["n_users"] != -1
    with pytest.raises(KeyError, match="training.nope"):
        untracked(config, "training.nope")


@pytest.mark.parametrize("change", [
    {},
    {"model.lora": {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["c_attn"]}, "model.name": None},
    {"training.debug_step_log": True, "training.uls_examples_per_user": 2, "training.optimizer": "sgd"},
    {"privacy.secret_seeds": True, "training.physical_batch_size": 8, "training.gradient_checkpointing": True},
])
def test_the_jobs_configs_rebuilt_from_params_read_as_the_whole_config(change):
    """What the pretraining, fine-tuning and random-stopping jobs read of the config is the same in the sections
    their scripts rebuild from the rules' params as in the whole validated config."""
    from userdp.config import validate_config
    from userdp.evaluation.random_stopping import RANDOM_STOPPING_UNTRACKED_KEYS, job_config
    from userdp.evaluation.targets import EVALUATE_UNTRACKED_KEYS
    from userdp.privacy.seed_secrecy import secret_seeds
    from userdp.training.settings import TrainSettings
    from userdp.training.targets import (FINETUNE_UNTRACKED_KEYS, finetune_config, finetune_params,
                                         pretrain_config, pretrain_params)
    from userdp.untracked import untracked

    full = validate_config(changed(**change))
    rates = [float(lr) for lr in full["training"]["learning_rates"]]
    settings = finetune_params(full, "tiny")
    rebuilt = {
        "finetune": finetune_config(settings, untracked(full, *FINETUNE_UNTRACKED_KEYS), rates),
        "random_stopping": job_config(settings, untracked(full, *RANDOM_STOPPING_UNTRACKED_KEYS),
                                      rates, full["evaluation"]["max_users"]),
    }
    for name, config in rebuilt.items():
        assert TrainSettings.from_config(config, 0.01) == TrainSettings.from_config(full, 0.01), name
        assert config["seed"] == full["seed"] and config["model"].get("lora") == full["model"].get("lora"), name
        assert secret_seeds(config, "tiny") == secret_seeds(full, "tiny"), name
        assert config["training"]["learning_rates"] == rates
    rs = rebuilt["random_stopping"]
    assert rs["evaluation"] == {k: full["evaluation"][k] for k in ("max_users", "batch_size")}
    assert rs["training"]["debug_step_log"] == full["training"]["debug_step_log"]
    assert {k.split(".")[0] for k in EVALUATE_UNTRACKED_KEYS} <= set(full)

    pre = pretrain_config(pretrain_params(full))
    assert pre["seed"] == full["seed"] and pre["tokenizer"] == {"sequence_length": full["tokenizer"]["sequence_length"]}
    expected = {k: v for k, v in full["model"].items() if k not in ("name", "lora")}
    assert pre["model"] == expected and pre["model"].get("name") is None
