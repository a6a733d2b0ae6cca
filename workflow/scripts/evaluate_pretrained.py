"""Snakemake script (rule evaluate_pretrained): next-token metrics of the model before fine-tuning on the
validation and test users -> metrics.json and users.parquet (each test user's scores). The fine-tuned runs are
evaluated by their fine-tuning job (scripts/finetune.py)."""

import torch

from userdp.errors import run_main
from userdp.evaluation.metrics import evaluate_models
from userdp.evaluation.select import pretrained_metrics
from userdp.evaluation.targets import EVAL_SPLITS, EVALUATE_UNTRACKED_KEYS
from userdp.io import write_json
from userdp.logutil import setup_logging
from userdp.untracked import untracked

log = setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    torch.set_num_threads(max(1, int(sm.threads)))
    p = sm.params
    settings = untracked(sm.config, *EVALUATE_UNTRACKED_KEYS)
    [result] = evaluate_models(
        [p.model],
        sm.input.tokens,
        dataset=sm.wildcards.dataset,
        root_seed=p.seed,
        max_users=p.max_users,
        # from the config, no params: they change no metric beyond float rounding
        batch_size=int(settings["evaluation"]["batch_size"]),
        device=settings["training"]["device"],
        local_model=p.local_model,
        splits=getattr(p, "splits", EVAL_SPLITS),  # absent: both (userdp.evaluation.targets.split_params)
        users_out=[sm.output.users],
    )
    result["model"] = str(p.model)
    write_json(sm.output.metrics, pretrained_metrics(result))


run_main(main, log)
