# userdp: user-level DP fine-tuning, end to end.
# Run: snakemake --cores 2   (see README.md). Config keys: config/README.md.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


# Front page of `snakemake --report` (describes the whole pipeline).
report: "workflow/report/workflow.rst"


# Our validation first (messages name the key and the allowed values), then
# Snakemake's own validation of the same schema (defaults are ours: snakemake's default filling
# fails on nullable objects such as model.lora).
include: "workflow/rules/common.smk"


validate(config, "workflow/schemas/config.schema.yaml", set_default=False)  # ours filled the defaults


include: "workflow/rules/data.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/experiments.smk"
include: "workflow/rules/audit.smk"
include: "workflow/rules/findings.smk"


rule all:
    input:
        all_targets(),
    default_target: True
