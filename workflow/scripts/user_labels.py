"""Snakemake script (rule user_labels): each user's group label (synthetic topic, local group_column)."""

import userdp.errors
import userdp.logutil
from userdp.data.labels import write_labels
from userdp.data.sources import open_job_source
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    name = snakemake.wildcards.dataset
    source, _ = open_job_source(snakemake)
    n = write_labels(source, snakemake.output[0], int(untracked(snakemake.config, "tokenizer.batch_rows")["tokenizer"]["batch_rows"]))
    log.info("dataset %s: %d users labelled", name, n)


userdp.errors.run_main(main, log)
