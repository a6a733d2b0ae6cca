# Figures: one rule per figure, `plot_<name>`, drawn by workflow/scripts/plot_figure.py
# with the plotting function userdp.plotting.registry names for <name>. Each reads
# only finished artifacts (changing a plot never reruns anything else) and writes
# PNG and PDF; the report shows them with their caption, workflow/report/<name>.rst.
# plot_contributions is written out in full; every other rule reuses it, or a
# rule derived from it (`use rule ... with:`), and changes its outputs, log and
# benchmark, and its inputs or params where they differ (a rule's params reach
# its plotting function as keyword arguments: the rules that add params are
# derived from by no other family). Rule all's figure targets:
# userdp.plotting.registry.figure_targets (tests/test_eval_figures.py checks that
# each is an output spelled here). figure_report and the category names: common.smk.


# ---------------------------------------------------------------- data and accounting


rule plot_contributions:
    input:
        stats="results/data/{dataset}/contributions.json",
        # With DP contribution statistics the figure draws the DP histogram.
        **({"release": "results/data/{dataset}/contributions_dp.json"} if stats_private(config) else {}),
    output:
        png=figure_report("results/figures/contributions_{dataset}.png", "contributions", REPORT_DATA,
                          figure="contributions", dataset="{dataset}"),
        pdf="results/figures/contributions_{dataset}.pdf",
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        "results/logs/figures/contributions_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/contributions_{dataset}.tsv"
    threads: 1
    priority: PRIORITY["side"]
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_figure.py"


use rule plot_contributions as plot_noise_vs_group_size with:
    input:
        comparison="results/accounting/comparison.parquet",
    output:
        png=figure_report("results/figures/noise_vs_group_size.png", "noise_vs_group_size", REPORT_ACCOUNTING,
                          format="PNG"),
        pdf=figure_report("results/figures/noise_vs_group_size.pdf", "noise_vs_group_size", REPORT_ACCOUNTING,
                          format="PDF"),
    log:
        "results/logs/figures/noise_vs_group_size.log",
    benchmark:
        "results/benchmarks/figures/noise_vs_group_size.tsv"


# ---------------------------------------------------------------- language-model fine-tuning, per dataset


use rule plot_contributions as plot_lm_loss_vs_epsilon with:
    input:
        summary="results/summary/{dataset}/metrics.parquet",
        pretrained="results/runs/{dataset}/pretrained/metrics.json",
    output:
        png=figure_report("results/figures/lm_loss_vs_epsilon_{dataset}.png", "lm_loss_vs_epsilon", REPORT_LM, "{dataset}",
                          figure="test loss vs epsilon", format="PNG"),
        pdf=figure_report("results/figures/lm_loss_vs_epsilon_{dataset}.pdf", "lm_loss_vs_epsilon", REPORT_LM, "{dataset}",
                          figure="test loss vs epsilon", format="PDF"),
    log:
        "results/logs/figures/lm_loss_vs_epsilon_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/lm_loss_vs_epsilon_{dataset}.tsv"


use rule plot_lm_loss_vs_epsilon as plot_lm_loss_vs_budget with:
    output:
        png=figure_report("results/figures/lm_loss_vs_budget_{dataset}.png", "lm_loss_vs_budget", REPORT_LM, "{dataset}",
                          figure="test loss vs compute budget", format="PNG"),
        pdf=figure_report("results/figures/lm_loss_vs_budget_{dataset}.pdf", "lm_loss_vs_budget", REPORT_LM, "{dataset}",
                          figure="test loss vs compute budget", format="PDF"),
    log:
        "results/logs/figures/lm_loss_vs_budget_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/lm_loss_vs_budget_{dataset}.tsv"


use rule plot_lm_loss_vs_epsilon as plot_lm_uls_minus_els with:
    output:
        png=figure_report("results/figures/lm_uls_minus_els_{dataset}.png", "lm_uls_minus_els", REPORT_LM, "{dataset}",
                          figure="ULS - ELS over epsilon and budget", format="PNG"),
        pdf=figure_report("results/figures/lm_uls_minus_els_{dataset}.pdf", "lm_uls_minus_els", REPORT_LM, "{dataset}",
                          figure="ULS - ELS over epsilon and budget", format="PDF"),
    log:
        "results/logs/figures/lm_uls_minus_els_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/lm_uls_minus_els_{dataset}.tsv"


use rule plot_lm_loss_vs_epsilon as plot_lm_loss_vs_group_size with:
    output:
        png=figure_report("results/figures/lm_loss_vs_group_size_{dataset}.png", "lm_loss_vs_group_size", REPORT_LM,
                          "{dataset}", figure="test loss vs group size G", format="PNG"),
        pdf=figure_report("results/figures/lm_loss_vs_group_size_{dataset}.pdf", "lm_loss_vs_group_size", REPORT_LM,
                          "{dataset}", figure="test loss vs group size G", format="PDF"),
    params:
        # The (epsilon, budget) of the G sweep (grid.group_sweep).
        epsilon=SWEEP_POINT["epsilon"],
        budget=SWEEP_POINT["budget"],
    log:
        "results/logs/figures/lm_loss_vs_group_size_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/lm_loss_vs_group_size_{dataset}.tsv"


use rule plot_lm_loss_vs_epsilon as plot_training_curves with:
    input:
        curves="results/summary/{dataset}/train_curves.parquet",
    output:
        png=figure_report("results/figures/training_curves_{dataset}.png", "training_curves", REPORT_LM, "{dataset}",
                          figure="training curves", format="PNG"),
        pdf=figure_report("results/figures/training_curves_{dataset}.pdf", "training_curves", REPORT_LM, "{dataset}",
                          figure="training curves", format="PDF"),
    log:
        "results/logs/figures/training_curves_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/training_curves_{dataset}.tsv"


use rule plot_lm_loss_vs_epsilon as plot_lm_options_loss_gap with:
    input:
        summary="results/summary/{dataset}/metrics.parquet",
        options="results/summary/{dataset}/options.parquet",
    output:
        png=figure_report("results/figures/lm_options_loss_gap_{dataset}.png", "lm_options_loss_gap", REPORT_LM, "{dataset}",
                          figure="loss gap to non-private per option", format="PNG"),
        pdf=figure_report("results/figures/lm_options_loss_gap_{dataset}.pdf", "lm_options_loss_gap", REPORT_LM, "{dataset}",
                          figure="loss gap to non-private per option", format="PDF"),
    log:
        "results/logs/figures/lm_options_loss_gap_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/lm_options_loss_gap_{dataset}.tsv"


# ---------------------------------------------------------------- who pays for privacy, per dataset


use rule plot_contributions as plot_groups_cost with:
    input:
        groups="results/summary/{dataset}/groups.parquet",
        summary="results/summary/{dataset}/metrics.parquet",
    output:
        png=figure_report("results/figures/groups_cost_{dataset}.png", "groups_cost", REPORT_GROUPS, "{dataset}",
                          figure="cost of privacy per user group", dataset="{dataset}"),
        pdf="results/figures/groups_cost_{dataset}.pdf",
    log:
        "results/logs/figures/groups_cost_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/groups_cost_{dataset}.tsv"


use rule plot_groups_cost as plot_groups_gap_vs_examples with:
    input:
        users="results/summary/{dataset}/users.parquet",
        summary="results/summary/{dataset}/metrics.parquet",
    output:
        png=figure_report("results/figures/groups_gap_vs_examples_{dataset}.png", "groups_gap_vs_examples", REPORT_GROUPS,
                          "{dataset}", figure="cost of privacy vs the user's examples", dataset="{dataset}"),
        pdf="results/figures/groups_gap_vs_examples_{dataset}.pdf",
    params:
        # groups.per_user_points: per dataset, whether to draw a point per held-out test user
        points=per_user_points(config),
    log:
        "results/logs/figures/groups_gap_vs_examples_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/groups_gap_vs_examples_{dataset}.tsv"


# ---------------------------------------------------------------- the audits (targets audit, audit_mechanism)


use rule plot_groups_cost as plot_audit_epsilon with:
    input:
        summary="results/audit/{dataset}/summary.parquet",
    output:
        png=figure_report("results/figures/audit_epsilon_{dataset}.png", "audit_epsilon", REPORT_AUDIT, "{dataset}",
                          figure="empirical vs claimed epsilon", dataset="{dataset}"),
        pdf="results/figures/audit_epsilon_{dataset}.pdf",
    log:
        "results/logs/figures/audit_epsilon_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/audit_epsilon_{dataset}.tsv"


use rule plot_groups_cost as plot_audit_mechanism_epsilon with:
    input:
        mechanism="results/audit/{dataset}/mechanism.csv",
    output:
        png=figure_report("results/figures/audit_mechanism_epsilon_{dataset}.png", "audit_mechanism_epsilon", REPORT_AUDIT,
                          "{dataset}", figure="empirical vs claimed epsilon, white-box", dataset="{dataset}"),
        pdf="results/figures/audit_mechanism_epsilon_{dataset}.pdf",
    log:
        "results/logs/figures/audit_mechanism_epsilon_{dataset}.log",
    benchmark:
        "results/benchmarks/figures/audit_mechanism_epsilon_{dataset}.tsv"


# ---------------------------------------------------------------- the mean-estimation study


use rule plot_noise_vs_group_size as plot_mean_estimation_vs_epsilon with:
    input:
        results="results/mean_estimation/results.parquet",
    output:
        png=figure_report("results/figures/mean_estimation_vs_epsilon.png", "mean_estimation_vs_epsilon",
                          REPORT_MEAN_ESTIMATION, figure="error vs epsilon", format="PNG"),
        pdf=figure_report("results/figures/mean_estimation_vs_epsilon.pdf", "mean_estimation_vs_epsilon",
                          REPORT_MEAN_ESTIMATION, figure="error vs epsilon", format="PDF"),
    log:
        "results/logs/figures/mean_estimation_vs_epsilon.log",
    benchmark:
        "results/benchmarks/figures/mean_estimation_vs_epsilon.tsv"


use rule plot_mean_estimation_vs_epsilon as plot_mean_estimation_vs_diversity with:
    output:
        png=figure_report("results/figures/mean_estimation_vs_diversity.png", "mean_estimation_vs_diversity",
                          REPORT_MEAN_ESTIMATION, figure="error vs intra-user diversity", format="PNG"),
        pdf=figure_report("results/figures/mean_estimation_vs_diversity.pdf", "mean_estimation_vs_diversity",
                          REPORT_MEAN_ESTIMATION, figure="error vs intra-user diversity", format="PDF"),
    log:
        "results/logs/figures/mean_estimation_vs_diversity.log",
    benchmark:
        "results/benchmarks/figures/mean_estimation_vs_diversity.tsv"


use rule plot_mean_estimation_vs_epsilon as plot_mean_estimation_vs_budget with:
    output:
        png=figure_report("results/figures/mean_estimation_vs_budget.png", "mean_estimation_vs_budget",
                          REPORT_MEAN_ESTIMATION, figure="error vs compute budget", format="PNG"),
        pdf=figure_report("results/figures/mean_estimation_vs_budget.pdf", "mean_estimation_vs_budget",
                          REPORT_MEAN_ESTIMATION, figure="error vs compute budget", format="PDF"),
    log:
        "results/logs/figures/mean_estimation_vs_budget.log",
    benchmark:
        "results/benchmarks/figures/mean_estimation_vs_budget.tsv"


use rule plot_mean_estimation_vs_epsilon as plot_mean_estimation_vs_group_size with:
    output:
        png=figure_report("results/figures/mean_estimation_vs_group_size.png", "mean_estimation_vs_group_size",
                          REPORT_MEAN_ESTIMATION, figure="error vs contribution bound G", format="PNG"),
        pdf=figure_report("results/figures/mean_estimation_vs_group_size.pdf", "mean_estimation_vs_group_size",
                          REPORT_MEAN_ESTIMATION, figure="error vs contribution bound G", format="PDF"),
    log:
        "results/logs/figures/mean_estimation_vs_group_size.log",
    benchmark:
        "results/benchmarks/figures/mean_estimation_vs_group_size.tsv"
