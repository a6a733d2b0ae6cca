"""Snakemake script (rules aggregate and aggregate_options): the per-dataset summary table (one row per grid
cell, or per cell of grid.options) and, for rule aggregate, the training curves.

Reads the cells' files the rule lists as its named inputs (plans, metrics,
ledgers, train_logs: userdp.evaluation.aggregate.SUMMARY_INPUTS), and grid.budgets
from its params (each cell's steps).
"""

from userdp.errors import run_main
from userdp.evaluation.aggregate import build_summary, write_summary
from userdp.logutil import setup_logging

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    config = {"grid": {"budgets": list(sm.params.budgets)}}  # what build_summary reads of the config
    summary, curves = build_summary(config, {name: list(files) for name, files in sm.input.items()})
    # rule aggregate_options writes no training curves
    write_summary(summary, curves, sm.output.parquet, sm.output.csv, sm.output.get("curves"))


run_main(main, log)
