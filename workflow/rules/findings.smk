# Findings: each claim of the study, its measured effect with a 95% interval
# over seeds and the verdict by the rule in userdp.evaluation.findings, from
# the finished tables only (the LM summaries, the pretrained models' metrics,
# the accounting comparison, the mean-estimation results). The table is the
# first entry of the report (category "Findings").
from userdp import layout
from userdp.evaluation import findings_job


rule findings:
    input:
        **findings_job.inputs(config),
    output:
        json=layout.FINDINGS,
        csv=report(
            layout.FINDINGS_CSV,
            caption="../report/findings_table.rst",
            category="Findings",
            labels={"table": "findings: claims, effects, verdicts"},
        ),
    params:
        # the findings section, the grid's datasets, their diversity levels, where the G sweep runs
        **findings_job.params(config),
    log:
        layout.LOG_FINDINGS,
    benchmark:
        layout.benchmark_of(layout.LOG_FINDINGS),
    threads: 1
    priority: PRIORITY["summary"]
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/findings.py"
