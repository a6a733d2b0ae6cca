"""Snakemake script: one figure of the language-model fine-tuning grid (params.figure).

Reads only the summary tables (and the pretrained model's metrics), so
changing a plot never reruns training or evaluation.
"""

import pandas as pd

from userdp.errors import run_main
from userdp.io import read_json
from userdp.logutil import setup_logging
from userdp.plotting import lm
from userdp.plotting.output import save_figure

log = setup_logging(snakemake.log[0])  # noqa: F821 (injected by Snakemake)


def main() -> None:
    sm = snakemake  # noqa: F821
    dataset = sm.wildcards.dataset
    figure = sm.params.figure
    if figure == "training_curves":
        fig = lm.training_curves(pd.read_parquet(sm.input.curves), dataset)
    else:
        summary = pd.read_parquet(sm.input.summary)
        pretrained = read_json(sm.input.pretrained)
        if figure == "loss_vs_epsilon":
            fig = lm.loss_vs_epsilon(summary, pretrained, dataset)
        elif figure == "loss_vs_budget":
            fig = lm.loss_vs_budget(summary, pretrained, dataset)
        elif figure == "loss_vs_group_size":
            fig = lm.loss_vs_group_size(summary, pretrained, dataset, sm.params.epsilon, sm.params.budget)
        else:
            raise ValueError(f"unknown figure {figure!r}")
    save_figure(fig, sm.output.png, sm.output.pdf)
    log.info("wrote %s and %s", sm.output.png, sm.output.pdf)


run_main(main, log)
