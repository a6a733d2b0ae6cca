"""Snakemake script (rule random_stopping): a private cell's selection by random stopping.

A random number of runs, each with a random learning rate, scored on
validation users; the best is released into the cell folder
(userdp.evaluation.random_stopping).
"""

import userdp.errors
import userdp.logutil
from userdp.evaluation import random_stopping
from userdp.grid import cell_of_dir
from userdp.privacy.spec import RunSpec
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    p = sm.params
    config = random_stopping.job_config(
        p.settings, untracked(sm.config, *random_stopping.RANDOM_STOPPING_UNTRACKED_KEYS), list(p.learning_rates),
        p.max_users)
    plan = str(sm.input.plan)
    cell = cell_of_dir(str(sm.output.ledger).rsplit("/", 1)[0], steps=RunSpec.load(plan).steps)
    job = random_stopping.job_from_cell(
        config, cell, plan=plan, tokens=str(sm.input.tokens), tokenizer=str(sm.input.tokenizer),
        model=str(p.model), threads=int(sm.threads), processes=int(getattr(sm.resources, "gpu", 0) or 0),
        log=str(sm.log[0]),
    )
    random_stopping.run_cell(job, out_metrics=sm.output.metrics, out_ledger=sm.output.ledger,
                             out_train_log=sm.output.train_log, out_users=sm.output.users, out_model=str(sm.output.model).rsplit("/", 1)[0])


userdp.errors.run_main(main, log)
