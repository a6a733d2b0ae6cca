"""Snakemake script: choose a cell's learning rate on validation users.

Writes the cell's metrics.json (test metrics of the chosen rate) and copies
that rate's ledger.json, train_log.parquet and per-user test scores (users.parquet) into the cell folder (the log
with the columns training.debug_step_log allows).
"""

from userdp.errors import run_main
from userdp.evaluation.select import select_cell
from userdp.logutil import setup_logging

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    select_cell(
        learning_rates=list(sm.params.learning_rates),
        eval_paths=list(sm.input.evals),
        user_paths=list(sm.input.users),
        ledger_paths=list(sm.input.ledgers),
        train_log_paths=list(sm.input.train_logs),
        out_metrics=sm.output.metrics,
        out_ledger=sm.output.ledger,
        out_train_log=sm.output.train_log,
        out_users=sm.output.users,
        debug_step_log=bool(sm.params.debug_step_log),
    )


run_main(main, log)
