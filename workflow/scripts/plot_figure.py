"""Snakemake script of every figure rule (figures.smk): draws the registered figure the rule is named for.

The figure, its inputs and its plot params come from
userdp.plotting.registry; this adapter only passes Snakemake's files on.
"""

from userdp.jobserver import delegate

delegate(snakemake)  # noqa: F821 (runs this job in the job fork server if there is one: userdp.jobserver)

from userdp.errors import run_main
from userdp.logutil import setup_logging
from userdp.plotting.registry import figure_of_rule

log = setup_logging(snakemake.log[0])  # noqa: F821 (injected by Snakemake)


def main() -> None:
    sm = snakemake  # noqa: F821
    figure = figure_of_rule(sm.rule)
    figure.draw(dict(sm.input.items()), sm.output.png, sm.output.pdf,
                dataset=getattr(sm.wildcards, "dataset", None), **dict(sm.params.items()))
    log.info("wrote %s and %s", sm.output.png, sm.output.pdf)


run_main(main, log)
