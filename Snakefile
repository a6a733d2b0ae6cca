# userdp: user-level DP fine-tuning, end to end.
# Run: snakemake --cores 2   (see README.md). Config keys: config/README.md.
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")
sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from userdp import layout
from userdp.config import read_config_file
from userdp.errors import ConfigError

# Snakemake's own message for a YAML syntax error names neither the file nor the line; ours does (files given
# with --configfile are parsed by snakemake before this file runs: `python -m userdp check-config FILE` names
# their line).
if os.path.exists(layout.DEFAULT_CONFIG):
    try:
        read_config_file(layout.DEFAULT_CONFIG)
    except ConfigError as exc:
        raise WorkflowError(str(exc)) from None


configfile: layout.DEFAULT_CONFIG


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
include: "workflow/rules/audit_mechanism.smk"
include: "workflow/rules/findings.smk"


rule all:
    input:
        all_targets(),
    default_target: True
