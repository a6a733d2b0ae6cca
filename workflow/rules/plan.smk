# Plan stage: each grid cell (method, epsilon, compute budget [, G]) -> a
# training plan (G, sampling rate, expected batch, calibrated sigma), and the
# accounting comparison (noise needed vs G for the tight ELS accountant, the
# group-privacy conversion and ULS) with its figure.
from userdp.config import steps_for_budget

# The non-private (eps~inf) cells choose G as the loosest private cell would.
REFERENCE_EPSILON = max(float(e) for e in config["grid"]["epsilons"])

# Per-user train counts n_u: users.parquet counts examples, but with
# tokenizer.long_examples = chunk one example becomes several rows of
# tokens.parquet and the training pool bounds G over rows, so the planner
# (and the DP statistics) count rows there instead.
COUNTS_FROM_TOKENS = config["tokenizer"]["long_examples"] == "chunk"
STATS_PRIVATE = bool(config["privacy"].get("contribution_stats", {}).get("private", False))
# The option's settings enter the plan's params only when it is on, so that
# adding the (off) key leaves existing plans' params, hence plans, unchanged.
# secret_seeds changes where randomness comes from, not the plan: never a plan param.
PLAN_PRIVACY = {
    k: v for k, v in config["privacy"].items()
    if (k != "contribution_stats" or STATS_PRIVATE) and k != "secret_seeds"
}


def count_inputs(wildcards):
    """The file the train users' counts come from: tokens.parquet (chunk mode) or users.parquet."""
    if COUNTS_FROM_TOKENS:
        return {"tokens": f"results/data/{wildcards.dataset}/tokens.parquet"}
    return {"users": f"results/data/{wildcards.dataset}/users.parquet"}


def plan_inputs(wildcards):
    ins = dict(count_inputs(wildcards), contributions=f"results/data/{wildcards.dataset}/contributions.json")
    if STATS_PRIVATE:
        ins["contributions_dp"] = f"results/data/{wildcards.dataset}/contributions_dp.json"
    return ins


# DP contribution statistics (privacy.contribution_stats.private): one noisy
# histogram of the train users' counts per dataset, drawn once, read by every
# cell's G rule; its Laplace event is composed into every cell's epsilon.
rule contribution_stats_dp:
    input:
        unpack(count_inputs),
    output:
        "results/data/{dataset}/contributions_dp.json",
    params:
        settings=config["privacy"].get("contribution_stats", {}),
        seed=config["seed"],
        secret=config["privacy"].get("secret_seeds", False),
    log:
        "results/logs/plan/contributions_dp_{dataset}.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/contribution_stats_dp.py"


rule plan:
    input:
        unpack(plan_inputs),
    output:
        "results/plan/{dataset}/method~{method}/eps~{eps}/budget~{budget}.json",
    params:
        privacy=PLAN_PRIVACY,
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
        privacy=PLAN_PRIVACY,
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
