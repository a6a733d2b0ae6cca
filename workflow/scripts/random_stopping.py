"""Snakemake script (rule random_stopping): a private cell's selection by random stopping.

A random number of runs, each with a random learning rate, scored on
validation users; the best is released into the cell folder
(userdp.evaluation.random_stopping).
"""

import copy

import userdp.config
import userdp.errors
import userdp.logutil
from userdp.evaluation import random_stopping
from userdp.layout import cell_of_dir

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    sm = snakemake  # noqa: F821
    config = userdp.config.validate_config(copy.deepcopy(dict(sm.config)))
    cell = cell_of_dir(str(sm.output.ledger).rsplit("/", 1)[0], config)
    job = random_stopping.job_from_cell(
        config, cell, plan=str(sm.input.plan), tokens=str(sm.input.tokens), tokenizer=str(sm.input.tokenizer),
        model=str(sm.params.model), threads=int(sm.threads), processes=int(getattr(sm.resources, "gpu", 0) or 0),
        log=str(sm.log[0]),
    )
    random_stopping.run_cell(job, out_metrics=sm.output.metrics, out_ledger=sm.output.ledger,
                             out_train_log=sm.output.train_log, out_model=str(sm.output.model).rsplit("/", 1)[0])


userdp.errors.run_main(main, log)
