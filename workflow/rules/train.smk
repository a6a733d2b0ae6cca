# Training stage: pretrain the small base model (rule pretrain), then one DP
# fine-tuning job per grid cell (rule finetune, and finetune_group for G-sweep
# cells) that trains every learning rate of training.learning_rates in turn,
# each into its own run folder (userdp.layout.RUN_DIR), and evaluates each
# run's model on held-out users: one process start-up (imports, base model,
# data) per cell instead of one per run and evaluation. With
# training.sweep_jobs: per_run, a job per run folder instead ({lr} wildcard).
# Targets: userdp.training.targets.train_targets(config).
from userdp import layout
from userdp.evaluation.targets import evaluation_params
from userdp.training.targets import (
    PRETRAINED_FILES,
    base_model,
    finetune_inputs,
    finetune_params,
    finetune_runtime,
    learning_rate_texts,
    per_cell_jobs,
    pretrain_inputs,
    pretrain_params,
    sweep_outputs,
)


# Params hold exactly the settings that change a rule's result (see
# userdp.training.targets.finetune_params / pretrain_params), so changing
# e.g. training.optimizer reruns every run while training.threads,
# physical_batch_size or checkpoint_every rerun nothing; privacy.secret_seeds
# enters as resolved per dataset (null: secret unless the source is synthetic),
# so the param is a function of the {dataset} wildcard. The scripts build their
# job from these params (userdp.training.targets.pretrain_config,
# finetune_config); the keys a run reads that change no result (physical_batch_size,
# checkpoint_every, gradient_checkpointing) it reads from the config
# (userdp.untracked): no param, so no rerun trigger. threads and gpus come as the
# rule's threads and resources. Paths: userdp.layout (a run folder per cell and learning rate).


rule pretrain:
    input:
        unpack(lambda wildcards: pretrain_inputs(config)),
    output:
        model=PRETRAINED_FILES[0],
        config=PRETRAINED_FILES[1],
    params:
        settings=pretrain_params(config),
    log:
        layout.LOG_PRETRAIN,
    benchmark:
        layout.benchmark_of(layout.LOG_PRETRAIN),
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
        unpack(lambda wildcards: finetune_inputs(config, wildcards)),
    output:
        # the ledger, train log and model of each run the job trains, and its evaluation on held-out users
        # (eval.json, eval_users.parquet: userdp.training.targets.sweep_outputs)
        sweep_outputs(layout.FINETUNE_RUN_DIR, config),
    params:
        # every rate (the same in both sweep_jobs modes, so switching reruns nothing); the job trains those of
        # its outputs' run folders, in order (a run that already finished, in an earlier job that was killed
        # or in a rerun of an unchanged run, is restored from its finished/ record)
        learning_rates=[float(lr) for lr in learning_rate_texts(config)],
        model=base_model(config),
        settings=lambda wildcards: finetune_params(config, wildcards.dataset),
        # what changes the metrics: which held-out users (max_users, seed) and splits (validation users only
        # where the cell chooses among several rates: evaluation.validation); changing it reruns the job, which
        # restores its finished runs and evaluates them again
        evaluation=evaluation_params(config),
    log:
        layout.LOG_FINETUNE if per_cell_jobs(config) else layout.LOG_FINETUNE_RUN,
    benchmark:
        layout.benchmark_of(layout.LOG_FINETUNE if per_cell_jobs(config) else layout.LOG_FINETUNE_RUN),
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


use rule finetune as finetune_group with:
    output:
        sweep_outputs(layout.FINETUNE_GROUP_RUN_DIR, config),
    log:
        layout.LOG_FINETUNE_GROUP if per_cell_jobs(config) else layout.LOG_FINETUNE_GROUP_RUN,
    benchmark:
        layout.benchmark_of(layout.LOG_FINETUNE_GROUP if per_cell_jobs(config) else layout.LOG_FINETUNE_GROUP_RUN),
