"""Snakemake script (rule prepare_public): the dataset's public (pretraining) text."""

import userdp.errors
import userdp.logutil
from userdp.data.sources import open_job_source
from userdp.data.prepare import write_public
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    name = snakemake.wildcards.dataset
    source, _ = open_job_source(snakemake)
    batch_rows = int(untracked(snakemake.config, "tokenizer.batch_rows")["tokenizer"]["batch_rows"])
    info = write_public(source, name, snakemake.output[0], batch_rows=batch_rows)
    log.info("dataset %s: public text written: %s", name, info)


userdp.errors.run_main(main, log)
