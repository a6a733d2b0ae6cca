# The synthetic mean-estimation study (docs/method.md section 9): calibration and
# simulation; its figures are rules of figures.smk (plot_mean_estimation_*). Calibration is its own rule (its params hold only
# the keys that change a sampling rate or a privacy target), so changing
# learning rates, diversities or seeds does not recalibrate, and changing a
# plot never recomputes anything.

# Targets for rule all (common.smk): the results table and the registry's figure targets.
# Only what changes a sampling rate or a privacy target triggers recalibration.
_ME_CALIBRATION_KEYS = (
    "n_users", "contributions_median", "contributions_sigma", "epsilons", "budgets", "group_sizes",
    "group_sweep_epsilon", "delta",
)
ME_CALIBRATION_PARAMS = dict(
    mean_estimation={k: config["mean_estimation"][k] for k in _ME_CALIBRATION_KEYS},
    seed=config["seed"],
    seeding=SEEDING,  # the seeding scheme (userdp.seeding.SCHEME): a new one reruns the job
    delta_exponent=config["privacy"]["delta_exponent"],
)


rule mean_estimation_calibration:
    output:
        "results/mean_estimation/calibration.parquet",
    params:
        calibration=ME_CALIBRATION_PARAMS,
    log:
        "results/logs/mean_estimation/calibration.log",
    benchmark:
        "results/benchmarks/mean_estimation/calibration.tsv"
    # one worker: on 2 cores a 2-thread job waits for both to be free, then blocks the fine-tuning jobs
    threads: 1
    priority: PRIORITY["side"]
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/mean_estimation_calibration.py"


rule mean_estimation:
    input:
        calibration="results/mean_estimation/calibration.parquet",
    output:
        results="results/mean_estimation/results.parquet",
        sweep="results/mean_estimation/lr_sweep.parquet",
    params:
        mean_estimation=config["mean_estimation"],
        seed=config["seed"],
        seeding=SEEDING,
        # delta when mean_estimation.delta is null; checked against the calibration's
        delta_exponent=config["privacy"]["delta_exponent"],
    log:
        "results/logs/mean_estimation/run.log",
    benchmark:
        "results/benchmarks/mean_estimation/run.tsv"
    threads: 1
    priority: PRIORITY["side"]
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/mean_estimation.py"

