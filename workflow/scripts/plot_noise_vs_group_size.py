"""Snakemake script (rule plot_noise_vs_group_size): the accounting comparison figure."""

import userdp.errors
import userdp.logutil
from userdp.plotting.accounting import plot_noise_vs_group_size

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    sm = snakemake  # noqa: F821
    plot_noise_vs_group_size(sm.input[0], sm.output.png, sm.output.pdf)
    log.info("wrote %s and %s", sm.output.png, sm.output.pdf)


userdp.errors.run_main(main, log)
