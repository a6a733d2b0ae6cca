"""Snakemake script: the DP (or eps=inf) fine-tuning runs of one cell, one per learning rate (rule finetune).

Every rate of training.learning_rates trains in turn in this process, into
its own run folder (userdp.training.finetune_job.launch_sweep); with
training.sweep_jobs: per_run the job has one run folder, its rate's. With a `gpu`
resource above 1 (training.gpus, or the profile's set-resources) each run is
spread over that many data-parallel processes (torchrun); see
userdp.training.distributed.
"""

import userdp.errors
import userdp.logutil
from userdp.training import finetune_job
from userdp.layout import LEDGER
from userdp.training.targets import FINETUNE_UNTRACKED_KEYS, finetune_config, sweep_runs
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    p = sm.params
    config = finetune_config(p.settings, untracked(sm.config, *FINETUNE_UNTRACKED_KEYS), p.learning_rates)
    w = sm.wildcards
    runs = sweep_runs(list(sm.output), LEDGER, list(p.learning_rates))
    jobs = [
        finetune_job.FinetuneJob(
            config=config, plan=str(sm.input.plan), tokens=str(sm.input.tokens), tokenizer=str(sm.input.tokenizer),
            model=str(p.model), run_dir=run_dir, learning_rate=float(lr), dataset=w.dataset,
            method=w.method, eps=w.eps, budget=w.budget, seed=int(w.seed), threads=int(sm.threads),
            log=str(sm.log[0]),
        )
        for lr, run_dir in runs
    ]
    finetune_job.launch_sweep(jobs, processes=int(getattr(sm.resources, "gpu", 0) or 0))


userdp.errors.run_main(main, log)
