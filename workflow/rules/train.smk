# Training stage: pretrain the small base model (rule pretrain), then one DP fine-tuning job per grid cell
# (rule finetune, and finetune_group for G-sweep cells) that trains every learning rate of
# training.learning_rates in turn, each into its own run folder (.../lr~{lr}), and evaluates each run's model on
# held-out users: one process start-up (imports, base model, data) per cell instead of one per run and
# evaluation. With training.sweep_jobs: per_run, a job per run folder instead ({lr} wildcard; common.smk:
# run_files).
from userdp.evaluation.targets import evaluation_params
from userdp.training.targets import finetune_runtime, pretrain_params


# Params hold exactly the settings that change a rule's result (userdp.training.targets.finetune_params,
# pretrain_params), so changing e.g. training.optimizer reruns every run while training.threads,
# physical_batch_size or checkpoint_every rerun nothing; privacy.secret_seeds enters as resolved per dataset
# (null: secret unless the source is synthetic), so the param is a function of the {dataset} wildcard. The
# scripts build their job from these params (userdp.training.targets.pretrain_config, finetune_config); the keys
# a run reads that change no result (physical_batch_size, checkpoint_every, gradient_checkpointing) it reads from
# the config (userdp.untracked): no param, so no rerun trigger. threads and gpus come as the rule's threads and
# resources.


rule pretrain:
    input:
        unpack(pretrain_inputs),
    output:
        model="results/model/pretrained/model.safetensors",
        config="results/model/pretrained/config.json",
    params:
        settings=pretrain_params(config),
    log:
        "results/logs/pretrain.log",
    benchmark:
        "results/benchmarks/pretrain.tsv"
    threads: config["training"]["threads"]
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["pretrain_mem_mb"],
        runtime=config["resources"]["pretrain_runtime"],
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/pretrain.py"


rule finetune:
    input:
        plan="results/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.json",
        tokens="results/data/{dataset}/tokens.parquet",
        tokenizer="results/tokenizer/tokenizer.json",
        **PRETRAINED_INPUTS,
    output:
        # the ledger, train log and model of each run the job trains, and its evaluation on held-out users
        # (eval.json, eval_users.parquet)
        run_files("results/runs/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}"),
    params:
        # learning_rates, model, settings (common.smk: FINETUNE_PARAMS)
        **FINETUNE_PARAMS,
        # what changes the metrics: which held-out users (max_users, seed) and splits (validation users only
        # where the cell chooses among several rates: evaluation.validation); changing it reruns the job, which
        # restores its finished runs and evaluates them again
        evaluation=evaluation_params(config),
    log:
        (
            "results/logs/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.log"
            if PER_CELL
            else "results/logs/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.log"
        ),
    benchmark:
        (
            "results/benchmarks/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.tsv"
            if PER_CELL
            else "results/benchmarks/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.tsv"
        )
    threads: config["training"]["threads"]
    priority: PRIORITY["finetune"]
    # gpu > 1 (training.gpus, or set-resources finetune: gpu: N in a profile):
    # the script runs the job as that many data-parallel processes (torchrun,
    # one GPU each; userdp.training.distributed), sharing `threads`.
    resources:
        mem_mb=max(config["resources"]["finetune_mem_mb"], config["evaluation"]["mem_mb"]),
        runtime=finetune_runtime(config),
        gpu=config["training"]["gpus"],
        cpus_per_gpu=config["training"]["threads"],
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/finetune.py"


# A G-sweep cell: its plan and folders have the group~{group} level.
use rule finetune as finetune_group with:
    input:
        plan="results/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}.json",
        tokens="results/data/{dataset}/tokens.parquet",
        tokenizer="results/tokenizer/tokenizer.json",
        **PRETRAINED_INPUTS,
    output:
        run_files("results/runs/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}/lr~{lr}"),
    log:
        (
            "results/logs/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}.log"
            if PER_CELL
            else "results/logs/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}/lr~{lr}.log"
        ),
    benchmark:
        (
            "results/benchmarks/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}.tsv"
            if PER_CELL
            else "results/benchmarks/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}/lr~{lr}.tsv"
        )


# A private cell of grid.options: its plan and folders have the option~{option} level, its settings are the
# option's config's (common.smk: OPTIONS).
use rule finetune as finetune_option with:
    input:
        plan="results/plan/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}.json",
        tokens="results/data/{dataset}/tokens.parquet",
        tokenizer="results/tokenizer/tokenizer.json",
        **PRETRAINED_INPUTS,
    output:
        run_files("results/runs/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}"),
    wildcard_constraints:
        option=OPTIONS_RE,
    log:
        (
            "results/logs/finetune/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.log"
            if PER_CELL
            else "results/logs/finetune/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.log"
        ),
    benchmark:
        (
            "results/benchmarks/finetune/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.tsv"
            if PER_CELL
            else "results/benchmarks/finetune/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.tsv"
        )
