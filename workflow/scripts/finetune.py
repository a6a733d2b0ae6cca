"""Snakemake script: the DP (or eps=inf) fine-tuning runs of one cell, one per learning rate, and their
evaluation on held-out users (rule finetune).

Every rate of training.learning_rates trains in turn in this process, into
its own run folder (userdp.training.finetune_job.launch_sweep); with
training.sweep_jobs: per_run the job has one run folder, its rate's. With a `gpu`
resource above 1 (training.gpus, or the profile's set-resources) each run is
spread over that many data-parallel processes (torchrun); see
userdp.training.distributed. Then each run's model is evaluated on the
held-out users (userdp.evaluation.metrics.evaluate_runs: eval.json and
eval_users.parquet in the run folder), in this process: one start-up serves
training and evaluation. Rule audit_finetune (`audit` param) trains only, with
the audit's own seeds.
"""

import torch

import userdp.errors
import userdp.logutil
from userdp.evaluation.metrics import evaluate_runs
from userdp.evaluation.targets import EVAL_SPLITS, EVALUATE_UNTRACKED_KEYS
from userdp.layout import LEDGER
from userdp.training import finetune_job
from userdp.training.targets import FINETUNE_UNTRACKED_KEYS, finetune_config, sweep_runs
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    p = sm.params
    config = finetune_config(p.settings, untracked(sm.config, *FINETUNE_UNTRACKED_KEYS), p.learning_rates)
    w = sm.wildcards
    audit = bool(getattr(p, "audit", False))
    runs = sweep_runs(list(sm.output), LEDGER, list(p.learning_rates))
    jobs = [
        finetune_job.FinetuneJob(
            config=config, plan=str(sm.input.plan), tokens=str(sm.input.tokens), tokenizer=str(sm.input.tokenizer),
            model=str(p.model), run_dir=run_dir, learning_rate=float(lr), dataset=w.dataset,
            method=w.method, eps=w.eps, budget=w.budget, seed=int(w.seed), threads=int(sm.threads),
            log=str(sm.log[0]), option=w.get("option"), audit=audit,
        )
        for lr, run_dir in runs
    ]
    finetune_job.launch_sweep(jobs, processes=int(getattr(sm.resources, "gpu", 0) or 0))
    if audit:  # rule audit_finetune: its runs are scored on their canaries instead
        return
    # the evaluation: which users and splits are the rule's `evaluation` param; batch size and device change
    # no metric beyond float rounding (from the config, no params)
    ev, settings = p.evaluation, untracked(sm.config, *EVALUATE_UNTRACKED_KEYS)
    torch.set_num_threads(max(1, int(sm.threads)))
    evaluate_runs(runs, str(sm.input.tokens), dataset=w.dataset, root_seed=int(ev["seed"]),
                  max_users=ev["max_users"], batch_size=int(settings["evaluation"]["batch_size"]),
                  device=settings["training"]["device"], splits=ev.get("splits", EVAL_SPLITS))


userdp.errors.run_main(main, log)
