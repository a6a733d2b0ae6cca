# Findings: each claim of the study, its measured effect with a 95% interval
# over seeds and the verdict by the rule in userdp.evaluation.findings, from
# the finished tables only (the LM summaries, the pretrained models' metrics,
# the accounting comparison, the mean-estimation results). The table is the
# first entry of the report (category "Findings").
from userdp.evaluation import findings_job


rule findings:
    input:
        # each grid dataset's summary, pretrained metrics and per-user table (claims 11-14), in grid order
        summaries=expand("results/summary/{dataset}/metrics.parquet", dataset=GRID_DATASETS),
        pretrained=expand("results/runs/{dataset}/pretrained/metrics.json", dataset=GRID_DATASETS),
        users=expand("results/summary/{dataset}/users.parquet", dataset=GRID_DATASETS),
        comparison="results/accounting/comparison.parquet",
        mean_estimation="results/mean_estimation/results.parquet",
        # claim 15 (grid.options): each grid dataset's options table, in grid order
        options=branch(bool(OPTIONS), then=expand("results/summary/{dataset}/options.parquet", dataset=GRID_DATASETS)),
        # claim 9 reads the audit (findings.audit): the findings rule then runs it
        audit_results=branch(
            config["findings"]["audit"],
            then=audit_files("results/audit/{dataset}/scores/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.json"),
        ),
        audit_scores=branch(
            config["findings"]["audit"],
            then=audit_files("results/audit/{dataset}/scores/method~{method}/eps~{eps}/budget~{budget}/seed~{seed}.parquet"),
        ),
    output:
        json="results/findings/{study}.json",
        csv=report(
            "results/findings/{study}.csv",
            caption="../report/findings_table.rst",
            category=REPORT_FINDINGS,
            labels={"table": "findings: claims, effects, verdicts"},
        ),
    params:
        # the findings section, the grid's datasets, their diversity levels, where the G sweep runs
        **findings_job.params(config),
    log:
        "results/logs/findings/{study}.log",
    benchmark:
        "results/benchmarks/findings/{study}.tsv"
    threads: 1
    priority: PRIORITY["summary"]
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/findings.py"
