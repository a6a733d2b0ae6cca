"""Snakemake script: build the small base model and pretrain it on public tokens (rule pretrain)."""

from pathlib import Path

import torch

import userdp.errors
import userdp.logutil
from userdp.training.pretrain import pretrain
from userdp.training.targets import pretrain_config

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    config = pretrain_config(snakemake.params.settings)
    torch.set_num_threads(int(snakemake.threads))
    public = snakemake.input.get("public")
    out_dir = Path(snakemake.output.model).parent
    info = pretrain(config, Path(snakemake.input.tokenizer).parent, public, out_dir)
    log.info("pretrained model written to %s: %s", out_dir, info)


userdp.errors.run_main(main, log)
