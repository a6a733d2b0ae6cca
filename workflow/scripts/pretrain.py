"""Snakemake script: build the small base model and pretrain it on public tokens (rule pretrain)."""

from userdp.jobserver import delegate

delegate(snakemake)  # noqa: F821 (runs this job in the job fork server if there is one: userdp.jobserver)

from pathlib import Path

import torch

import userdp.errors
import userdp.logutil
from userdp.training.pretrain import pretrain
from userdp.training.targets import pretrain_config

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    config = pretrain_config(snakemake.params.settings)  # noqa: F821
    torch.set_num_threads(int(snakemake.threads))  # noqa: F821
    public = snakemake.input.get("public")  # noqa: F821
    out_dir = Path(snakemake.output.model).parent  # noqa: F821
    info = pretrain(config, Path(snakemake.input.tokenizer).parent, public, out_dir)  # noqa: F821
    log.info("pretrained model written to %s: %s", out_dir, info)


userdp.errors.run_main(main, log)
