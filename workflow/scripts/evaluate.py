"""Snakemake script: next-token metrics of one model on validation and test users.

Rules `evaluate` (a fine-tuned run at one learning rate -> eval.json) and
`evaluate_pretrained` (the model before fine-tuning -> metrics.json).
"""

import torch

from userdp.errors import run_main
from userdp.evaluation.metrics import evaluate_model
from userdp.evaluation.select import pretrained_metrics
from userdp.io import write_json
from userdp.logutil import setup_logging

log = setup_logging(snakemake.log[0])  # noqa: F821 (injected by Snakemake)


def main() -> None:
    sm = snakemake  # noqa: F821
    torch.set_num_threads(max(1, int(sm.threads)))
    p = sm.params
    result = evaluate_model(
        p.model,
        sm.input.tokens,
        dataset=sm.wildcards.dataset,
        root_seed=p.seed,
        max_users=p.max_users,
        # Not params (they change no metric beyond float rounding, so changing them reruns nothing).
        batch_size=int(sm.config["evaluation"]["batch_size"]),
        device=sm.config["training"]["device"],
        local_model=p.local_model,
    )
    result["model"] = str(p.model)
    if p.learning_rate is None:
        result = pretrained_metrics(result)
    else:
        result["learning_rate"] = float(p.learning_rate)
    write_json(sm.output[0], result)


run_main(main, log)
