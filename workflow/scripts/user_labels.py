"""Snakemake script (rule user_labels): each user's group label (synthetic topic, local group_column)."""

from userdp.jobserver import delegate

delegate(snakemake)  # noqa: F821 (runs this job in the job fork server if there is one: userdp.jobserver)

import userdp.errors
import userdp.logutil
from userdp.data.labels import write_labels
from userdp.data.sources import open_job_source

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    name = snakemake.wildcards.dataset  # noqa: F821
    source, _ = open_job_source(snakemake)  # noqa: F821
    n = write_labels(source, snakemake.output[0], int(snakemake.params.untracked["tokenizer"]["batch_rows"]))  # noqa: F821
    log.info("dataset %s: %d users labelled", name, n)


userdp.errors.run_main(main, log)
