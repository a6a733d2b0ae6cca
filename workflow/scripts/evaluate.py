"""Snakemake script: next-token metrics of models on validation and test users.

Rules `evaluate` (the fine-tuned model of each run folder of the job: every
learning rate of one cell in turn, or one run under training.sweep_jobs:
per_run -> each run folder's eval.json and eval_users.parquet) and
`evaluate_pretrained` (the model before fine-tuning -> metrics.json and
users.parquet). The Parquet files hold each test user's scores.
"""

from pathlib import Path

import torch

from userdp.errors import run_main
from userdp.evaluation.metrics import evaluate_models
from userdp.evaluation.select import pretrained_metrics
from userdp.evaluation.targets import EVAL_SPLITS, EVALUATE_UNTRACKED_KEYS
from userdp.io import write_json
from userdp.layout import EVAL, EVAL_USERS, RUN_MODEL
from userdp.logutil import setup_logging
from userdp.training.targets import sweep_runs
from userdp.untracked import untracked

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    torch.set_num_threads(max(1, int(sm.threads)))
    p = sm.params
    settings = untracked(sm.config, *EVALUATE_UNTRACKED_KEYS)
    pretrained = hasattr(p, "learning_rate")  # rule evaluate_pretrained: one model, no learning rate
    if pretrained:
        models, rates, outputs = [p.model], [None], [sm.output.metrics]
        users = [sm.output.users]
    else:
        runs = sweep_runs(list(sm.output), EVAL, list(p.learning_rates))
        models = [str(Path(run_dir) / RUN_MODEL) for _, run_dir in runs]
        rates = [lr for lr, _ in runs]
        outputs = [str(Path(run_dir) / EVAL) for _, run_dir in runs]
        users = [str(Path(run_dir) / EVAL_USERS) for _, run_dir in runs]  # per-user test scores (held-out users)
    results = evaluate_models(
        models,
        sm.input.tokens,
        dataset=sm.wildcards.dataset,
        root_seed=p.seed,
        max_users=p.max_users,
        # from the config, no params: they change no metric beyond float rounding
        batch_size=int(settings["evaluation"]["batch_size"]),
        device=settings["training"]["device"],
        local_model=p.local_model,
        splits=getattr(p, "splits", EVAL_SPLITS),  # absent: both (userdp.evaluation.targets.split_params)
        users_out=users,
    )
    for model, rate, result, out in zip(models, rates, results, outputs, strict=True):
        result["model"] = str(model)
        if rate is None:
            result = pretrained_metrics(result)
        else:
            result["learning_rate"] = float(rate)
        write_json(out, result)


run_main(main, log)
