# Figures of the language-model fine-tuning grid: one rule per figure, each
# reading only the summary tables (plotting is separate from computation, so
# changing a plot never reruns training). Every output goes into the
# `snakemake --report` HTML with its caption from workflow/report/.
# The file names are listed by userdp.evaluation.targets.lm_figure_targets.

LM_REPORT_CATEGORY = "Language-model fine-tuning"
_LM_SUMMARY = dict(
    summary="results/summary/{dataset}/metrics.parquet",
    pretrained="results/runs/{dataset}/pretrained/metrics.json",
)


rule plot_lm_loss_vs_epsilon:
    input:
        **_LM_SUMMARY,
    output:
        png=report(
            "results/figures/lm_loss_vs_epsilon_{dataset}.png",
            caption="../report/lm_loss_vs_epsilon.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "test loss vs epsilon", "format": "PNG"},
        ),
        pdf=report(
            "results/figures/lm_loss_vs_epsilon_{dataset}.pdf",
            caption="../report/lm_loss_vs_epsilon.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "test loss vs epsilon", "format": "PDF"},
        ),
    params:
        figure="loss_vs_epsilon",
    log:
        "results/logs/figures/lm_loss_vs_epsilon_{dataset}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_lm.py"


rule plot_lm_loss_vs_budget:
    input:
        **_LM_SUMMARY,
    output:
        png=report(
            "results/figures/lm_loss_vs_budget_{dataset}.png",
            caption="../report/lm_loss_vs_budget.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "test loss vs compute budget", "format": "PNG"},
        ),
        pdf=report(
            "results/figures/lm_loss_vs_budget_{dataset}.pdf",
            caption="../report/lm_loss_vs_budget.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "test loss vs compute budget", "format": "PDF"},
        ),
    params:
        figure="loss_vs_budget",
    log:
        "results/logs/figures/lm_loss_vs_budget_{dataset}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_lm.py"


rule plot_lm_loss_vs_group_size:
    input:
        **_LM_SUMMARY,
    output:
        png=report(
            "results/figures/lm_loss_vs_group_size_{dataset}.png",
            caption="../report/lm_loss_vs_group_size.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "test loss vs group size G", "format": "PNG"},
        ),
        pdf=report(
            "results/figures/lm_loss_vs_group_size_{dataset}.pdf",
            caption="../report/lm_loss_vs_group_size.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "test loss vs group size G", "format": "PDF"},
        ),
    params:
        figure="loss_vs_group_size",
        # userdp.config.iter_cells runs the G sweep at the first epsilon and budget.
        epsilon=float(config["grid"]["epsilons"][0]),
        budget=int(config["grid"]["budgets"][0]["compute"]),
    log:
        "results/logs/figures/lm_loss_vs_group_size_{dataset}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_lm.py"


rule plot_training_curves:
    input:
        curves="results/summary/{dataset}/train_curves.parquet",
    output:
        png=report(
            "results/figures/training_curves_{dataset}.png",
            caption="../report/training_curves.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "training curves", "format": "PNG"},
        ),
        pdf=report(
            "results/figures/training_curves_{dataset}.pdf",
            caption="../report/training_curves.rst",
            category=LM_REPORT_CATEGORY,
            subcategory="{dataset}",
            labels={"figure": "training curves", "format": "PDF"},
        ),
    params:
        figure="training_curves",
    log:
        "results/logs/figures/training_curves_{dataset}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_lm.py"
