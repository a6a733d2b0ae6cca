# The user-level membership audit (target `audit`; docs/audits.md, "Auditing
# the released model"). Canary users, each included with probability 1/2,
# are added to a dataset's train users; each audited cell (userdp.layout.
# audit_cells: audit.methods x audit.epsilons + the non-private reference, at
# audit.budget) is planned by the planner and trained by rule finetune's
# script and params, exactly like a grid cell; every canary is scored by the
# trained model's loss and by its likelihood ratio against the pretrained
# model; and the summary sets the empirical epsilon lower bound next to the
# claimed one. Not part of rule all: run `snakemake --cores 2 audit`.
import userdp.evaluation.audit_targets as audit_lib
from userdp import grid, layout
from userdp.plotting.registry import figure_targets
from userdp.training.targets import base_model, run_outputs

_AUDIT_BUDGET, _AUDIT_STEPS = grid.audit_budget(config)


rule audit_canaries:
    input:
        unpack(lambda wildcards: audit_lib.canary_inputs(config, wildcards.dataset)),
    output:
        canaries=layout.AUDIT_CANARIES,
        tokens=layout.AUDIT_TOKENS,
    params:
        canaries=audit_lib.canary_params(config),
    log:
        layout.LOG_AUDIT_CANARIES,
    benchmark:
        layout.benchmark_of(layout.LOG_AUDIT_CANARIES),
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
        unpack(lambda wildcards: audit_lib.plan_inputs(config, wildcards.dataset)),
    output:
        layout.AUDIT_PLAN,
    wildcard_constraints:
        budget=str(_AUDIT_BUDGET),
    params:
        privacy=lambda wildcards: audit_lib.plan_privacy(config, wildcards.method, wildcards.eps),
        steps=_AUDIT_STEPS,
        reference_epsilon=lambda wildcards: audit_lib.reference_epsilon(config, wildcards.method, wildcards.eps),
    log:
        layout.LOG_AUDIT_PLAN,
    benchmark:
        layout.benchmark_of(layout.LOG_AUDIT_PLAN),
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
        unpack(lambda wildcards: audit_lib.finetune_inputs(config, wildcards)),
    output:
        **run_outputs(layout.AUDIT_RUN_DIR, config),
    wildcard_constraints:
        budget=str(_AUDIT_BUDGET),
    log:
        layout.LOG_AUDIT_FINETUNE,
    benchmark:
        layout.benchmark_of(layout.LOG_AUDIT_FINETUNE),


rule audit_score:
    input:
        unpack(lambda wildcards: audit_lib.score_inputs(config, wildcards)),
    output:
        scores=layout.AUDIT_SCORES,
        result=layout.AUDIT_RESULT,
    wildcard_constraints:
        budget=str(_AUDIT_BUDGET),
    params:
        audit=audit_lib.score_params(config),
        reference=base_model(config),
        local_reference=not config["model"]["name"],
    log:
        layout.LOG_AUDIT_SCORE,
    benchmark:
        layout.benchmark_of(layout.LOG_AUDIT_SCORE),
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
        results=lambda wildcards: audit_lib.result_files(config, wildcards.dataset),
    output:
        summary=layout.AUDIT_SUMMARY,
        csv=layout.AUDIT_SUMMARY_CSV,
        table=report(
            layout.AUDIT_TABLE,
            caption="../report/audit_table.rst",
            category="Privacy audit",
            subcategory="{dataset}",
            labels={"table": "empirical vs claimed epsilon", "dataset": "{dataset}"},
        ),
    log:
        layout.LOG_AUDIT_SUMMARY,
    benchmark:
        layout.benchmark_of(layout.LOG_AUDIT_SUMMARY),
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
        audit_lib.audit_targets(config),
        figure_targets(config, family="audit"),
