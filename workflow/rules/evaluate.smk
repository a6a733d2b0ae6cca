# Evaluation stage: next-token metrics of the pretrained model (those of every
# fine-tuned run are written by its fine-tuning job, rule finetune: eval.json
# and eval_users.parquet in the run folder), learning-rate selection on
# validation users, and the per-dataset summary table.
#
# Validation and test users are disjoint from the training users (their data
# is treated like test data). Choosing among k learning rates composes the k
# runs: select_lr writes the released model's epsilon (privacy.selection)
# into the cell's ledger (userdp.evaluation.select).
#
# `evaluation_targets()` (common.smk) lists every file of this stage (for rule all);
# `snakemake evaluation` builds them and the LM figures (figures.smk).

import userdp.evaluation.targets as eval_targets
from userdp.plotting.registry import figure_targets


rule evaluate_pretrained:
    input:
        model=list(PRETRAINED_INPUTS.values()),
        tokens="results/data/{dataset}/tokens.parquet",
    output:
        metrics="results/runs/{dataset}/pretrained/metrics.json",
        users="results/runs/{dataset}/pretrained/users.parquet",
    params:
        # the hub name in model.name, or the folder pretraining writes (a recorded param: base_model)
        model=base_model,
        local_model=not config["model"]["name"],
        # what changes the metrics: which users (max_users, seed) and splits; evaluation.batch_size and
        # training.device change them only by float rounding: the script reads them from the config, so they are
        # no param and no rerun trigger (userdp.evaluation.targets.EVALUATE_UNTRACKED_KEYS)
        **eval_targets.evaluation_params(config, selects=False),
    log:
        "results/logs/evaluate/{dataset}/pretrained.log",
    benchmark:
        "results/benchmarks/evaluate/{dataset}/pretrained.tsv"
    threads: config["training"]["threads"]
    priority: PRIORITY["evaluate"]
    resources:
        mem_mb=config["evaluation"]["mem_mb"],
        runtime=config["evaluation"]["runtime"],
        gpu=min(1, config["training"]["gpus"]),
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/evaluate_pretrained.py"


rule select_lr:
    input:
        # each learning rate's run of the cell, in config order
        evals=expand("results/runs/{dataset}/{cell}/lr~{lr}/eval.json", lr=LEARNING_RATES, allow_missing=True),
        users=expand("results/runs/{dataset}/{cell}/lr~{lr}/eval_users.parquet", lr=LEARNING_RATES, allow_missing=True),
        ledgers=expand("results/runs/{dataset}/{cell}/lr~{lr}/ledger.json", lr=LEARNING_RATES, allow_missing=True),
        train_logs=expand(
            "results/runs/{dataset}/{cell}/lr~{lr}/train_log.parquet", lr=LEARNING_RATES, allow_missing=True
        ),
    output:
        metrics="results/runs/{dataset}/{cell}/metrics.json",
        ledger="results/runs/{dataset}/{cell}/ledger.json",
        train_log="results/runs/{dataset}/{cell}/train_log.parquet",
        # the chosen run's per-user test scores (held-out users; rule groups reads them)
        users="results/runs/{dataset}/{cell}/users.parquet",
    wildcard_constraints:
        # every cell, or only the eps~inf references under random stopping (rule random_stopping below)
        cell=eval_targets.select_lr_cells(config),
    params:
        learning_rates=[float(lr) for lr in config["training"]["learning_rates"]],
        # which train-log columns the cell releases (userdp.training.step_log)
        debug_step_log=bool(config["training"]["debug_step_log"]),
    log:
        "results/logs/select_lr/{dataset}/{cell}.log",
    benchmark:
        "results/benchmarks/select_lr/{dataset}/{cell}.tsv"
    threads: 1
    priority: PRIORITY["select"]
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/select_lr.py"


if eval_targets.random_stopping(config):

    # privacy.selection.accounting: random_stopping. Each private cell is ONE job:
    # a random number of runs (each with a random learning rate, its own samples
    # and noise), each scored on validation users, the best released into the
    # cell folder (its model in model/); the number of runs and the other runs
    # are never written out (userdp.evaluation.random_stopping). Its runtime is
    # that of several finetune jobs: `runtime` allows 3 x the mean number of
    # runs; a job killed earlier resumes where it stopped.
    rule random_stopping:
        input:
            plan=cell_plan,
            tokens="results/data/{dataset}/tokens.parquet",
            tokenizer="results/tokenizer/tokenizer.json",
            **PRETRAINED_INPUTS,
        output:
            metrics="results/runs/{dataset}/{cell}/metrics.json",
            ledger="results/runs/{dataset}/{cell}/ledger.json",
            train_log="results/runs/{dataset}/{cell}/train_log.parquet",
            users="results/runs/{dataset}/{cell}/users.parquet",
            # the released model (or adapter): config, weights
            model_config=model_files("results/runs/{dataset}/{cell}/model")[0],
            model=model_files("results/runs/{dataset}/{cell}/model")[1],
        wildcard_constraints:
            cell=layout.PRIVATE_CELL_RE,
        params:
            # learning_rates, model, settings: what changes its runs (common.smk: FINETUNE_PARAMS)
            **FINETUNE_PARAMS,
            debug_step_log=bool(config["training"]["debug_step_log"]),
            **eval_targets.evaluation_params(config, selects=True),
        log:
            "results/logs/random_stopping/{dataset}/{cell}.log",
        # no benchmark file: its wall time reveals the number of runs K, which stays secret (docs/privacy.md)
        threads: config["training"]["threads"]
        priority: PRIORITY["finetune"]
        resources:
            mem_mb=max(config["resources"]["finetune_mem_mb"], config["evaluation"]["mem_mb"]),
            runtime=eval_targets.random_stopping_runtime(config),
            gpu=config["training"]["gpus"],
            cpus_per_gpu=config["training"]["threads"],
        conda:
            "../envs/userdp.yaml"
        script:
            "../scripts/random_stopping.py"


rule aggregate:
    input:
        # every cell of the dataset's grid, in the same order in each list
        plans=lambda wc: [c.plan_path for c in cells(wc.dataset)],
        metrics=lambda wc: cell_files("results/runs/{dataset}/{cell}/metrics.json", wc.dataset),
        ledgers=lambda wc: cell_files("results/runs/{dataset}/{cell}/ledger.json", wc.dataset),
        train_logs=lambda wc: cell_files("results/runs/{dataset}/{cell}/train_log.parquet", wc.dataset),
    output:
        parquet="results/summary/{dataset}/metrics.parquet",
        # the summary table in the report (one row per run: plan, ledger and metrics; docs/artifacts.md)
        csv=report(
            "results/summary/{dataset}/metrics.csv",
            caption="../report/metrics_table.rst",
            category=REPORT_LM,
            subcategory="{dataset}",
            labels={"table": "metrics per cell", "dataset": "{dataset}"},
        ),
        curves="results/summary/{dataset}/train_curves.parquet",
    params:
        # grid.budgets: the steps of each cell's compute budget (userdp.grid.cell_of_dir), in compute order
        # (the listed order changes no summary)
        budgets=sorted(config["grid"]["budgets"], key=lambda b: int(b["compute"])),
    log:
        "results/logs/aggregate/{dataset}.log",
    benchmark:
        "results/benchmarks/aggregate/{dataset}.tsv"
    threads: 1
    priority: PRIORITY["summary"]
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/aggregate.py"


# The cells of grid.options, summarised as rule aggregate does (one row per cell, plus its `option`); the
# findings compare each with the grid's cell of the same dataset, method, epsilon, budget and seed.
rule aggregate_options:
    input:
        plans=lambda wc: [c.plan_path for c in cells(wc.dataset, options=True)],
        metrics=lambda wc: cell_files("results/runs/{dataset}/{cell}/metrics.json", wc.dataset, options=True),
        ledgers=lambda wc: cell_files("results/runs/{dataset}/{cell}/ledger.json", wc.dataset, options=True),
        train_logs=lambda wc: cell_files("results/runs/{dataset}/{cell}/train_log.parquet", wc.dataset, options=True),
    output:
        parquet="results/summary/{dataset}/options.parquet",
        csv=report(
            "results/summary/{dataset}/options.csv",
            caption="../report/options_table.rst",
            category=REPORT_LM,
            subcategory="{dataset}",
            labels={"table": "metrics per option cell", "dataset": "{dataset}"},
        ),
    params:
        budgets=sorted(config["grid"]["budgets"], key=lambda b: int(b["compute"])),
    log:
        "results/logs/aggregate/{dataset}_options.log",
    benchmark:
        "results/benchmarks/aggregate/{dataset}_options.tsv"
    threads: 1
    priority: PRIORITY["summary"]
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/aggregate.py"


# Who pays for privacy: every evaluated test user's loss per run (users.parquet, not in the report: held-out
# users' data) and the cost of privacy per user group (groups.csv in the report; userdp.evaluation.groups).
rule groups:
    input:
        # every cell's and the pretrained model's per-user test scores, the summary (each cell's G) and, where
        # the dataset labels its users, the labels
        unpack(user_labels_input),
        cells=lambda wc: cell_files("results/runs/{dataset}/{cell}/users.parquet", wc.dataset),
        pretrained="results/runs/{dataset}/pretrained/users.parquet",
        summary="results/summary/{dataset}/metrics.parquet",
    output:
        users="results/summary/{dataset}/users.parquet",
        parquet="results/summary/{dataset}/groups.parquet",
        csv=report(
            "results/summary/{dataset}/groups.csv",
            caption="../report/groups_table.rst",
            category=REPORT_GROUPS,
            subcategory="{dataset}",
            labels={"table": "cost of privacy per user group", "dataset": "{dataset}"},
        ),
    params:
        # the groups section but per_user_points (that one changes only the scatter figure)
        settings={k: v for k, v in config["groups"].items() if k != "per_user_points"},
        seed=config["seed"],
    log:
        "results/logs/groups/{dataset}.log",
    benchmark:
        "results/benchmarks/groups/{dataset}.tsv"
    threads: 1
    priority: PRIORITY["summary"]
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/groups.py"


rule evaluation:
    """Convenience target: `snakemake evaluation` runs the evaluation stage and the LM figures."""
    input:
        evaluation_targets(),
        figure_targets(config, family="lm"),
