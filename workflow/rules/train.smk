# Training stage: pretrain the small base model (rule pretrain), then one DP
# fine-tuning run per grid cell and learning rate (rule finetune, and
# finetune_group for G-sweep cells) into results/runs/.../lr~{lr}/.
# Targets: userdp.training.targets.train_targets(config).
from userdp.training.targets import (
    PRETRAINED,
    base_model,
    finetune_inputs,
    finetune_params,
    pretrain_inputs,
    pretrain_params,
)


wildcard_constraints:
    lr=r"[0-9]+(\.[0-9]+)?(e-?[0-9]+)?",


# Params hold exactly the settings that change a rule's result (see
# userdp.training.targets.finetune_params / pretrain_params), so changing
# e.g. training.optimizer reruns every run while training.threads,
# physical_batch_size or checkpoint_every rerun nothing. The scripts read the
# full config; every result-changing key they read must be in these params.
RUN = "results/runs/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}"
GROUP_RUN = "results/runs/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}/lr~{lr}"


rule pretrain:
    input:
        unpack(lambda wildcards: pretrain_inputs(config)),
    output:
        model=f"{PRETRAINED}/model.safetensors",
        config=f"{PRETRAINED}/config.json",
    params:
        settings=pretrain_params(config),
    log:
        "results/logs/pretrain.log",
    threads: config["training"]["threads"]
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
        ledger=f"{RUN}/ledger.json",
        train_log=f"{RUN}/train_log.parquet",
        model=f"{RUN}/model/model.safetensors",
        model_config=f"{RUN}/model/config.json",
    params:
        lr=lambda wildcards: float(wildcards.lr),
        model=base_model(config),
        settings=finetune_params(config),
    log:
        "results/logs/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.log",
    threads: config["training"]["threads"]
    # gpu > 1 (training.gpus, or set-resources finetune: gpu: N in a profile):
    # the script runs the job as that many data-parallel processes (torchrun,
    # one GPU each; userdp.training.distributed), sharing `threads`.
    resources:
        mem_mb=config["resources"]["finetune_mem_mb"],
        runtime=config["resources"]["finetune_runtime"],
        gpu=config["training"]["gpus"],
        cpus_per_gpu=config["training"]["threads"],
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/finetune.py"


use rule finetune as finetune_group with:
    output:
        ledger=f"{GROUP_RUN}/ledger.json",
        train_log=f"{GROUP_RUN}/train_log.parquet",
        model=f"{GROUP_RUN}/model/model.safetensors",
        model_config=f"{GROUP_RUN}/model/config.json",
    log:
        "results/logs/finetune/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}/seed~{seed}/lr~{lr}.log",
