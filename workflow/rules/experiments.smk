# The synthetic mean-estimation study (method.md section 9): calibration,
# simulation and one rule per figure. Calibration is its own rule (its params
# hold only the keys that change a sampling rate or a privacy target), so
# changing learning rates, diversities or seeds does not recalibrate, and
# changing a plot never recomputes anything.

# Targets for rule all: userdp.experiments.mean_estimation.workflow_targets().

from userdp.experiments.mean_estimation import FIGURES as ME_FIGURES

ME_DIR = "results/mean_estimation"
ME_REPORT_CATEGORY = "Mean estimation (synthetic)"
# Only what changes a sampling rate or a privacy target triggers recalibration.
ME_CALIBRATION_PARAMS = dict(
    mean_estimation={
        k: config["mean_estimation"][k]
        for k in (
            "n_users", "contributions_median", "contributions_sigma", "epsilons", "budgets", "group_sizes",
            "group_sweep_epsilon", "delta",
        )
    },
    seed=config["seed"],
    delta_exponent=config["privacy"]["delta_exponent"],
)
_me_figure = lambda name, fmt: report(
    f"results/figures/mean_estimation_{name}.{fmt}",
    caption=f"../report/mean_estimation_{name}.rst",
    category=ME_REPORT_CATEGORY,
    labels={"figure": ME_FIGURES[name], "format": fmt.upper()},
)


rule mean_estimation_calibration:
    output:
        f"{ME_DIR}/calibration.parquet",
    params:
        calibration=ME_CALIBRATION_PARAMS,
    log:
        "results/logs/mean_estimation/calibration.log",
    threads: 2
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/mean_estimation_calibration.py"


rule mean_estimation:
    input:
        calibration=f"{ME_DIR}/calibration.parquet",
    output:
        results=f"{ME_DIR}/results.parquet",
        sweep=f"{ME_DIR}/lr_sweep.parquet",
    params:
        mean_estimation=config["mean_estimation"],
        seed=config["seed"],
    log:
        "results/logs/mean_estimation/run.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/mean_estimation.py"


rule plot_mean_estimation_vs_epsilon:
    input:
        f"{ME_DIR}/results.parquet",
    output:
        png=_me_figure("vs_epsilon", "png"),
        pdf=_me_figure("vs_epsilon", "pdf"),
    params:
        which="vs_epsilon",
    log:
        "results/logs/figures/mean_estimation_vs_epsilon.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_mean_estimation.py"


rule plot_mean_estimation_vs_diversity:
    input:
        f"{ME_DIR}/results.parquet",
    output:
        png=_me_figure("vs_diversity", "png"),
        pdf=_me_figure("vs_diversity", "pdf"),
    params:
        which="vs_diversity",
    log:
        "results/logs/figures/mean_estimation_vs_diversity.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_mean_estimation.py"


rule plot_mean_estimation_vs_budget:
    input:
        f"{ME_DIR}/results.parquet",
    output:
        png=_me_figure("vs_budget", "png"),
        pdf=_me_figure("vs_budget", "pdf"),
    params:
        which="vs_budget",
    log:
        "results/logs/figures/mean_estimation_vs_budget.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_mean_estimation.py"


rule plot_mean_estimation_vs_group_size:
    input:
        f"{ME_DIR}/results.parquet",
    output:
        png=_me_figure("vs_group_size", "png"),
        pdf=_me_figure("vs_group_size", "pdf"),
    params:
        which="vs_group_size",
    log:
        "results/logs/figures/mean_estimation_vs_group_size.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_mean_estimation.py"
