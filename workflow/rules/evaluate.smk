# Evaluation stage: next-token metrics of every fine-tuned run (one per
# learning rate) and of the pretrained model, learning-rate selection on
# validation users, and the per-dataset summary table.
#
# Validation and test users are disjoint from the training users (their data
# is treated like test data). Choosing among k learning rates composes the k
# runs: select_lr adds `epsilon_including_lr_selection` to the cell's ledger.
#
# `evaluation_targets()` lists every file of this stage and of figures.smk
# (for rule all); `snakemake evaluation` builds them.
import os
from functools import partial

import userdp.evaluation.targets as eval_targets

evaluation_targets = partial(eval_targets.evaluation_targets, config)

# Params hold what changes the metrics: which users are evaluated (max_users,
# seed). evaluation.batch_size and training.device are read by the script from
# the config instead: right padding plus masking makes the loss independent of
# how sequences are batched, and evaluation draws no random numbers on the
# device, so both change the metrics only by float rounding and changing them
# reruns nothing (tests/test_rerun_triggers.py, tests/test_eval_metrics.py).
_EVAL_PARAMS = dict(
    max_users=config["evaluation"]["max_users"],
    seed=config["seed"],
)


rule evaluate:
    input:
        model=lambda wc: eval_targets.run_model_files(wc.dataset, wc.cell, wc.lr),
        tokens="results/data/{dataset}/tokens.parquet",
    output:
        "results/runs/{dataset}/{cell}/lr~{lr}/eval.json",
    wildcard_constraints:
        cell=eval_targets.CELL_REGEX,
        lr=eval_targets.LR_REGEX,
    params:
        model=lambda wc, input: os.path.dirname(input.model[0]),
        local_model=True,
        learning_rate=lambda wc: float(wc.lr),
        **_EVAL_PARAMS,
    log:
        "results/logs/evaluate/{dataset}/{cell}/lr~{lr}.log",
    threads: config["training"]["threads"]
    resources:
        mem_mb=config["evaluation"]["mem_mb"],
        runtime=config["evaluation"]["runtime"],
        gpu=min(1, config["training"]["gpus"]),
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/evaluate.py"


rule evaluate_pretrained:
    input:
        model=eval_targets.pretrained_model_files(config),
        tokens="results/data/{dataset}/tokens.parquet",
    output:
        "results/runs/{dataset}/pretrained/metrics.json",
    params:
        # the local folder of the pretrained model, or the hub name in model.name
        model=lambda wc, input: os.path.dirname(input.model[0]) if len(input.model) else config["model"]["name"],
        local_model=not config["model"]["name"],
        learning_rate=None,
        **_EVAL_PARAMS,
    log:
        "results/logs/evaluate/{dataset}/pretrained.log",
    threads: config["training"]["threads"]
    resources:
        mem_mb=config["evaluation"]["mem_mb"],
        runtime=config["evaluation"]["runtime"],
        gpu=min(1, config["training"]["gpus"]),
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/evaluate.py"


rule select_lr:
    input:
        evals=lambda wc: eval_targets.lr_run_files(config, wc.dataset, wc.cell, "eval.json"),
        ledgers=lambda wc: eval_targets.lr_run_files(config, wc.dataset, wc.cell, "ledger.json"),
        train_logs=lambda wc: eval_targets.lr_run_files(config, wc.dataset, wc.cell, "train_log.parquet"),
    output:
        metrics="results/runs/{dataset}/{cell}/metrics.json",
        ledger="results/runs/{dataset}/{cell}/ledger.json",
        train_log="results/runs/{dataset}/{cell}/train_log.parquet",
    wildcard_constraints:
        cell=eval_targets.CELL_REGEX,
    params:
        learning_rates=[float(lr) for lr in config["training"]["learning_rates"]],
    log:
        "results/logs/select_lr/{dataset}/{cell}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/select_lr.py"


rule aggregate:
    input:
        unpack(lambda wc: eval_targets.summary_inputs(config, wc.dataset)),
    output:
        parquet="results/summary/{dataset}/metrics.parquet",
        csv="results/summary/{dataset}/metrics.csv",
        curves="results/summary/{dataset}/train_curves.parquet",
    log:
        "results/logs/aggregate/{dataset}.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/aggregate.py"


rule evaluation:
    """Convenience target: `snakemake evaluation` runs the evaluation stage and the LM figures."""
    input:
        evaluation_targets(),
