# Plan stage: each grid cell (method, epsilon, compute budget [, G]) -> a
# training plan (G, sampling rate, expected batch, calibrated sigma), and the
# accounting comparison (noise needed vs G for the tight ELS accountant, the
# group-privacy conversion and ULS) with its figure.
from userdp.config import steps_for_budget

# The non-private (eps~inf) cells choose G as the loosest private cell would.
REFERENCE_EPSILON = max(float(e) for e in config["grid"]["epsilons"])


rule plan:
    input:
        users="results/data/{dataset}/users.parquet",
        contributions="results/data/{dataset}/contributions.json",
    output:
        "results/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.json",
    params:
        privacy=config["privacy"],
        steps=lambda wildcards: steps_for_budget(config, wildcards.budget),
        reference_epsilon=REFERENCE_EPSILON,
        group_size=None,
    log:
        "results/logs/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plan_cell.py"


use rule plan as plan_group_sweep with:
    output:
        "results/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}.json",
    params:
        privacy=config["privacy"],
        steps=lambda wildcards: steps_for_budget(config, wildcards.budget),
        reference_epsilon=REFERENCE_EPSILON,
        group_size=lambda wildcards: int(wildcards.group),
    log:
        "results/logs/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}.log",


rule accounting_comparison:
    output:
        "results/accounting/comparison.parquet",
    params:
        comparison=config["privacy"]["comparison"],
        tolerance=config["privacy"]["calibration_tolerance"],
        max_noise_multiplier=config["privacy"]["max_noise_multiplier"],
    log:
        "results/logs/accounting/comparison.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/accounting_comparison.py"


rule plot_noise_vs_group_size:
    input:
        "results/accounting/comparison.parquet",
    output:
        png=report(
            "results/figures/noise_vs_group_size.png",
            caption="../report/noise_vs_group_size.rst",
            category="Accounting",
        ),
        pdf="results/figures/noise_vs_group_size.pdf",
    log:
        "results/logs/figures/noise_vs_group_size.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_noise_vs_group_size.py"
