"""Snakemake script: one DP (or eps=inf) fine-tuning run of one cell at one learning rate (rule finetune).

With a `gpu` resource above 1 (training.gpus, or the profile's set-resources)
the run is spread over that many data-parallel processes (torchrun); see
userdp.training.distributed.
"""

import copy
from pathlib import Path

import userdp.config
import userdp.errors
import userdp.logutil
from userdp.training import finetune_job

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    sm = snakemake  # noqa: F821
    config = userdp.config.validate_config(copy.deepcopy(dict(sm.config)))
    w = sm.wildcards
    job = finetune_job.FinetuneJob(
        config=config, plan=str(sm.input.plan), tokens=str(sm.input.tokens), tokenizer=str(sm.input.tokenizer),
        model=str(sm.params.model), run_dir=str(Path(sm.output.ledger).parent), learning_rate=float(sm.params.lr),
        dataset=w.dataset, method=w.method, eps=w.eps, budget=w.budget, seed=int(w.seed),
        threads=int(sm.threads), log=str(sm.log[0]),
    )
    finetune_job.launch(job, processes=int(getattr(sm.resources, "gpu", 0) or 0))


userdp.errors.run_main(main, log)
