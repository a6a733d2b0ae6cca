"""Snakemake script: build the small base model and pretrain it on public tokens (rule pretrain)."""

import copy
from pathlib import Path

import torch

import userdp.config
import userdp.errors
import userdp.logutil
from userdp.training.pretrain import pretrain

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    config = userdp.config.validate_config(copy.deepcopy(dict(snakemake.config)))  # noqa: F821
    torch.set_num_threads(int(snakemake.threads))  # noqa: F821
    public = snakemake.input.get("public")  # noqa: F821
    out_dir = Path(snakemake.output.model).parent  # noqa: F821
    info = pretrain(config, Path(snakemake.input.tokenizer).parent, public, out_dir)  # noqa: F821
    log.info("pretrained model written to %s: %s", out_dir, info)


userdp.errors.run_main(main, log)
