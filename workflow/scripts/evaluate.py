"""Snakemake script: next-token metrics of models on validation and test users.

Rules `evaluate` (every learning rate's fine-tuned model of one cell -> each
run folder's eval.json, in one process) and `evaluate_pretrained` (the model
before fine-tuning -> metrics.json).
"""

import torch

from userdp.errors import run_main
from userdp.evaluation.metrics import evaluate_models
from userdp.evaluation.select import pretrained_metrics
from userdp.io import write_json
from userdp.logutil import setup_logging

log = setup_logging(snakemake.log[0])  # noqa: F821 (injected by Snakemake)


def main() -> None:
    sm = snakemake  # noqa: F821
    torch.set_num_threads(max(1, int(sm.threads)))
    p = sm.params
    models, rates, outputs = list(p.models), list(p.learning_rates), list(sm.output)
    if not len(models) == len(rates) == len(outputs):
        raise RuntimeError(f"evaluate: {len(models)} models, {len(rates)} learning rates, {len(outputs)} outputs")
    results = evaluate_models(
        models,
        sm.input.tokens,
        dataset=sm.wildcards.dataset,
        root_seed=p.seed,
        max_users=p.max_users,
        # Not params (they change no metric beyond float rounding, so changing them reruns nothing).
        batch_size=int(sm.config["evaluation"]["batch_size"]),
        device=sm.config["training"]["device"],
        local_model=p.local_model,
    )
    for model, rate, result, out in zip(models, rates, results, outputs):
        result["model"] = str(model)
        if rate is None:
            result = pretrained_metrics(result)
        else:
            result["learning_rate"] = float(rate)
        write_json(out, result)


run_main(main, log)
