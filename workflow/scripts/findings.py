"""Snakemake script (rule findings): the study's findings table (userdp.evaluation.findings)."""

from userdp.errors import run_main
from userdp.evaluation.findings_job import run
from userdp.logutil import setup_logging

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    result = run(dict(sm.params.items()), list(sm.input.summaries), list(sm.input.pretrained), sm.input.comparison,
                 sm.input.mean_estimation, sm.output.json, sm.output.csv,
                 audit_results=list(getattr(sm.input, "audit_results", [])),
                 audit_scores=list(getattr(sm.input, "audit_scores", [])), users=list(sm.input.users),
                 options=list(getattr(sm.input, "options", [])))
    log.info("%s: %s", sm.output.json, ", ".join(f"{v} {k}" for k, v in result["counts"].items()))


run_main(main, log)
