# The white-box audit of the mechanism (target `audit_mechanism`; docs/audits.md,
# "White-box audit of the mechanism"). Canary users with a known gradient
# direction, each included with probability 1/2, are trained through the real
# engine for every cell of audit.methods x audit.epsilons (noise from the
# project's calibration); every privatised update is scored and the one-run
# bound sets an empirical epsilon next to the claimed one. Not part of rule
# all: run `snakemake --cores 2 audit_mechanism`.
import userdp.evaluation.mechanism_audit as mechanism_audit_lib
from userdp.plotting.registry import figure_targets


rule audit_mechanism_table:
    output:
        "results/audit/{dataset}/mechanism.csv",
    params:
        audit=mechanism_audit_lib.mechanism_params(config),
    log:
        "results/logs/audit/{dataset}/mechanism.log",
    benchmark:
        "results/benchmarks/audit/{dataset}/mechanism.tsv"
    threads: config["training"]["threads"]
    resources:
        mem_mb=4000,
        runtime=60,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/audit_mechanism.py"


rule audit_mechanism:
    """Target: the white-box audit of the mechanism, results/audit/{dataset}/mechanism.csv and its figure per audited dataset."""
    input:
        expand("results/audit/{dataset}/mechanism.csv", dataset=AUDITED_DATASETS),
        figure_targets(config, family="audit_mechanism"),
