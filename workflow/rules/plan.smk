# Plan stage: each grid cell (method, epsilon, compute budget [, G]) -> a
# training plan (G, sampling rate, expected batch, calibrated sigma), and the
# accounting comparison (noise needed vs G for the tight ELS accountant, the
# group-privacy conversion and ULS) with its figure.
import userdp.privacy.targets as plan_inputs_lib

# Counts n_u come from tokens.parquet in chunk mode (rows, the unit the pool
# bounds), else users.parquet; the DP histogram is an input only when
# privacy.contribution_stats.private is on (common.smk: COUNTS_INPUT, DP_STATS_INPUT).
#
# Params hold exactly what changes a cell's plan (userdp.privacy.targets):
# the privacy.* keys this cell reads (never privacy.comparison), and the
# reference epsilon (the largest grid epsilon) only for the eps~inf cells
# that use it, so adding an epsilon re-plans no existing private cell.
_plan_privacy = lambda wildcards: plan_inputs_lib.plan_privacy_params(
    config, wildcards.method, wildcards.eps, wildcards.get("group")
)
_reference_epsilon = lambda wildcards: plan_inputs_lib.reference_epsilon_param(
    config, wildcards.method, wildcards.eps, wildcards.get("group")
)


# DP contribution statistics (privacy.contribution_stats.private): one noisy
# histogram of the train users' counts per dataset, drawn once, read by every
# cell's G rule; its Laplace event is composed into every cell's epsilon.
rule contribution_stats_dp:
    input:
        **COUNTS_INPUT,
    output:
        "results/data/{dataset}/contributions_dp.json",
    params:
        settings=config["privacy"].get("contribution_stats", {}),
        seed=config["seed"],
        # privacy.secret_seeds as resolved for this dataset (null: secret unless the source is synthetic)
        secret=lambda wildcards: plan_inputs_lib.secret_seeds(config, wildcards.dataset),
    log:
        "results/logs/plan/contributions_dp_{dataset}.log",
    benchmark:
        "results/benchmarks/plan/contributions_dp_{dataset}.tsv"
    threads: 1
    priority: PRIORITY["chain"]  # every plan waits for it
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/contribution_stats_dp.py"


rule plan:
    input:
        contributions="results/data/{dataset}/contributions.json",
        **COUNTS_INPUT,
        **DP_STATS_INPUT,
    output:
        "results/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.json",
    params:
        privacy=_plan_privacy,
        steps=lambda wildcards: grid.steps_for_budget(config, wildcards.budget),
        reference_epsilon=_reference_epsilon,
        selection=plan_inputs_lib.selection_param(config),
        group_size=None,
    log:
        "results/logs/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.log",
    benchmark:
        "results/benchmarks/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.tsv"
    threads: 1
    priority: PRIORITY["plan"]
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
        privacy=_plan_privacy,
        steps=lambda wildcards: grid.steps_for_budget(config, wildcards.budget),
        reference_epsilon=_reference_epsilon,
        selection=plan_inputs_lib.selection_param(config),
        group_size=lambda wildcards: int(wildcards.group),
    log:
        "results/logs/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}.log",
    benchmark:
        "results/benchmarks/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}/group~{group}.tsv"


# A private cell of grid.options: the plan of the option's config (calibrated to the same epsilon); eps~inf has no
# option cells.
use rule plan as plan_option with:
    output:
        "results/plan/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}.json",
    params:
        privacy=lambda wildcards: plan_inputs_lib.plan_privacy_params(OPTIONS[wildcards.option], wildcards.method,
                                                                      wildcards.eps),
        steps=lambda wildcards: grid.steps_for_budget(config, wildcards.budget),
        reference_epsilon=None,
        selection=plan_inputs_lib.selection_param(config),
        group_size=None,
    wildcard_constraints:
        option=OPTIONS_RE,
        eps=layout.NUMBER_RE,
    log:
        "results/logs/plan/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}.log",
    benchmark:
        "results/benchmarks/plan/{dataset}/option~{option}/method~{method}/eps~{eps}/budget~{budget}.tsv"


rule accounting_comparison:
    output:
        "results/accounting/comparison.parquet",
    params:
        comparison=config["privacy"]["comparison"],
        tolerance=config["privacy"]["calibration_tolerance"],
        max_noise_multiplier=config["privacy"]["max_noise_multiplier"],
    log:
        "results/logs/accounting/comparison.log",
    benchmark:
        "results/benchmarks/accounting/comparison.tsv"
    threads: 1
    priority: PRIORITY["side"]
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/accounting_comparison.py"

