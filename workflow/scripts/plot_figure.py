"""Snakemake script of every figure rule (figures.smk): draws the registered figure the rule is named for.

The figure, its inputs and its plot params come from
userdp.plotting.registry; this adapter only passes Snakemake's files on.
"""

from userdp.errors import run_main
from userdp.logutil import setup_logging
from userdp.plotting.registry import figure_of_rule

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    figure = figure_of_rule(sm.rule)
    figure.draw(dict(sm.input.items()), sm.output.png, sm.output.pdf,
                dataset=getattr(sm.wildcards, "dataset", None), **dict(sm.params.items()))
    log.info("wrote %s and %s", sm.output.png, sm.output.pdf)


run_main(main, log)
