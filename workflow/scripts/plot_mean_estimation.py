"""Draw one mean-estimation figure (thin adapter; params.which names it)."""

import pandas as pd

from userdp.errors import run_main
from userdp.logutil import setup_logging
from userdp.plotting.mean_estimation import plot

log = setup_logging(snakemake.log[0])


def main() -> None:
    results = pd.read_parquet(snakemake.input[0])
    plot(snakemake.params.which, results, snakemake.output.png, snakemake.output.pdf)
    log.info("wrote %s and %s", snakemake.output.png, snakemake.output.pdf)


run_main(main, log)
