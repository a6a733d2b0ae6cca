"""Snakemake script: one DP (or eps=inf) fine-tuning run of one cell at one learning rate (rule finetune)."""

import copy
from pathlib import Path

import torch

import userdp.config
import userdp.errors
import userdp.logutil
from userdp.io import read_json
from userdp.training import engine, models, pool
from userdp.training.sampling import derive_seed

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    sm = snakemake  # noqa: F821
    config = userdp.config.validate_config(copy.deepcopy(dict(sm.config)))
    torch.set_num_threads(int(sm.threads))
    w = sm.wildcards
    plan = read_json(sm.input.plan)
    G = int(plan["group_size"])
    # The bounded subset depends on the dataset, G and the run seed only, so
    # ELS and ULS runs with the same G see the same examples.
    bound_seed = derive_seed(config["seed"], w.dataset, int(w.seed), G, "bounding")
    train_pool = pool.build_pool(pool.read_train_tokens(sm.input.tokens), G, bound_seed)
    tokenizer = models.load_tokenizer(Path(sm.input.tokenizer).parent)
    pad_id = models.special_ids(tokenizer)["pad_token_id"]
    model = models.load_model(sm.params.model)
    vocab = model.get_input_embeddings().num_embeddings
    if vocab < len(tokenizer):
        raise userdp.errors.ConfigError(
            f"model {sm.params.model} has {vocab} token embeddings but the tokenizer in results/tokenizer has "
            f"{len(tokenizer)} tokens; set tokenizer.name to the model's own tokenizer (model.name {sm.params.model!r})."
        )
    settings = engine.TrainSettings.from_config(config, float(sm.params.lr))
    seeds = engine.run_seeds(config["seed"], int(w.seed), w.dataset, w.method, w.eps, w.budget, G)
    paths = engine.RunPaths(Path(sm.output.ledger).parent)
    outcome = engine.train(model, train_pool, plan, settings, paths, seeds, pad_id)
    if not outcome.complete:
        raise RuntimeError(f"run stopped at step {outcome.steps_completed}/{plan['steps']}")


userdp.errors.run_main(main, log)
