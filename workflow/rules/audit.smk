# The user-level membership audit (target `audit`; docs/audits.md, "Auditing
# the released model"). Canary users, each included with probability 1/2,
# are added to a dataset's train users; each audited cell (userdp.grid.
# audit_cells: audit.methods x audit.epsilons + the non-private reference, at
# audit.budget) is planned by the planner and trained by rule finetune's
# script and params, exactly like a grid cell; every canary is scored by the
# trained model's loss and by its likelihood ratio against the pretrained
# model; and the summary sets the empirical epsilon lower bound next to the
# claimed one. Not part of rule all: run `snakemake --cores 2 audit`.
import userdp.evaluation.audit_targets as audit_lib
from userdp.plotting.registry import figure_targets


rule audit_canaries:
    input:
        unpack(audit_canary_inputs),
    output:
        canaries="results/audit/{dataset}/canaries.parquet",
        tokens="results/audit/{dataset}/tokens.parquet",
    params:
        canaries=audit_lib.canary_params(config),
    log:
        "results/logs/audit/{dataset}/canaries.log",
    benchmark:
        "results/benchmarks/audit/{dataset}/canaries.tsv"
    threads: 1
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/audit_canaries.py"


# The plan rule's privacy params for the same cell; counts from the audit's
# training table (the dataset's train users plus the included canaries).
rule audit_plan:
    input:
        tokens="results/audit/{dataset}/tokens.parquet",
        contributions="results/data/{dataset}/contributions.json",
        **DP_STATS_INPUT,
    output:
        "results/audit/{dataset}/plan/method~{method}/eps~{eps}/budget~{budget}.json",
    wildcard_constraints:
        budget=str(AUDIT_BUDGET),
    params:
        privacy=lambda wildcards: audit_lib.plan_privacy(config, wildcards.method, wildcards.eps),
        steps=AUDIT_STEPS,
        reference_epsilon=lambda wildcards: audit_lib.reference_epsilon(config, wildcards.method, wildcards.eps),
    log:
        "results/logs/audit/{dataset}/plan/method~{method}/eps~{eps}/budget~{budget}.log",
    benchmark:
        "results/benchmarks/audit/{dataset}/plan/method~{method}/eps~{eps}/budget~{budget}.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/audit_plan.py"


# Rule finetune's script, params and resources, on the audit's plan and table.
use rule finetune as audit_finetune with:
    input:
        plan="results/audit/{dataset}/plan/method~{method}/eps~{eps}/budget~{budget}.json",
        tokens="results/audit/{dataset}/tokens.parquet",
        tokenizer="results/tokenizer/tokenizer.json",
        **PRETRAINED_INPUTS,
    output:
        # one run, at the audit's learning rate: its ledger, train log and model (no evaluation)
        run_outputs("results/audit/{dataset}/runs/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}"),
    params:
        **FINETUNE_PARAMS,
        # an audit run: its own samples and noise (userdp.training.run_seeds), not the grid's, and no held-out
        # evaluation (rule audit_score scores it on its canaries)
        audit=True,
    wildcard_constraints:
        budget=str(AUDIT_BUDGET),
    resources:
        # one run, trained only: no evaluation's memory or minutes, no other learning rate's minutes
        mem_mb=config["resources"]["finetune_mem_mb"],
        runtime=config["resources"]["finetune_runtime"],
        gpu=config["training"]["gpus"],
        cpus_per_gpu=config["training"]["threads"],
    log:
        "results/logs/audit/{dataset}/finetune/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.log",
    benchmark:
        "results/benchmarks/audit/{dataset}/finetune/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}/lr~{lr}.tsv"


rule audit_score:
    input:
        # the audited model (at the audit's one learning rate), its ledger, the canaries, the reference model
        model=model_files(
            f"results/audit/{{dataset}}/runs/method~{{method}}/eps~{{eps}}/budget~{{budget}}/seed~{{seed}}/lr~{AUDIT_LR}/model"
        ),
        ledger=f"results/audit/{{dataset}}/runs/method~{{method}}/eps~{{eps}}/budget~{{budget}}/seed~{{seed}}/lr~{AUDIT_LR}/ledger.json",
        canaries="results/audit/{dataset}/canaries.parquet",
        reference=list(PRETRAINED_INPUTS.values()),
    output:
        scores="results/audit/{dataset}/scores/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.parquet",
        result="results/audit/{dataset}/scores/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.json",
    wildcard_constraints:
        budget=str(AUDIT_BUDGET),
    params:
        audit=audit_lib.score_params(config),
        reference=base_model,
        local_reference=not config["model"]["name"],
    log:
        "results/logs/audit/{dataset}/score/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.log",
    benchmark:
        "results/benchmarks/audit/{dataset}/score/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.tsv"
    threads: config["training"]["threads"]
    resources:
        mem_mb=config["evaluation"]["mem_mb"],
        runtime=config["evaluation"]["runtime"],
        gpu=min(1, config["training"]["gpus"]),
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/audit_score.py"


rule audit_summary:
    input:
        results=lambda wc: audit_files(
            "results/audit/{dataset}/scores/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.json", wc.dataset
        ),
    output:
        summary="results/audit/{dataset}/summary.parquet",
        csv="results/audit/{dataset}/summary.csv",
        table=report(
            "results/audit/{dataset}/table.html",
            caption="../report/audit_table.rst",
            category=REPORT_AUDIT,
            subcategory="{dataset}",
            labels={"table": "empirical vs claimed epsilon", "dataset": "{dataset}"},
        ),
    log:
        "results/logs/audit/{dataset}/summary.log",
    benchmark:
        "results/benchmarks/audit/{dataset}/summary.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/audit_summary.py"


rule audit:
    """Target: the membership audit of every audited cell, its summary, report table and figure."""
    input:
        expand(
            "results/audit/{dataset}/{file}", dataset=AUDITED_DATASETS, file=["summary.parquet", "summary.csv", "table.html"]
        ),
        figure_targets(config, family="audit"),
