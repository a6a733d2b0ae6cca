"""Snakemake script (rule prepare_public): the dataset's public (pretraining) text."""

from userdp.jobserver import delegate

delegate(snakemake)  # noqa: F821 (runs this job in the job fork server if there is one: userdp.jobserver)

import userdp.errors
import userdp.logutil
from userdp.data.sources import open_job_source
from userdp.data.prepare import write_public

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    name = snakemake.wildcards.dataset  # noqa: F821
    source, _ = open_job_source(snakemake)  # noqa: F821
    batch_rows = int(snakemake.params.untracked["tokenizer"]["batch_rows"])  # noqa: F821
    info = write_public(source, name, snakemake.output[0], batch_rows=batch_rows)  # noqa: F821
    log.info("dataset %s: public text written: %s", name, info)


userdp.errors.run_main(main, log)
