"""Snakemake script (rule plot_contributions): the per-user contribution histogram."""

import userdp.errors
import userdp.logutil
from userdp.plotting.contributions import plot_contributions

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    plot_contributions(snakemake.input[0], snakemake.output.png, snakemake.output.pdf,  # noqa: F821
                       dataset=snakemake.wildcards.dataset)  # noqa: F821
    log.info("wrote %s and %s", snakemake.output.png, snakemake.output.pdf)  # noqa: F821


userdp.errors.run_main(main, log)
