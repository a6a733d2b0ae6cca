"""Snakemake script (rule prepare_data): clean, group users, split, contribution statistics."""

from userdp.jobserver import delegate

delegate(snakemake)  # noqa: F821 (runs this job in the job fork server if there is one: userdp.jobserver)

from pathlib import Path

import pyarrow as pa

import userdp.errors
import userdp.logutil
from userdp.data.sources import open_job_source
from userdp.data.prepare import prepare_dataset

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    pa.set_cpu_count(max(1, int(snakemake.threads)))  # noqa: F821
    name = snakemake.wildcards.dataset  # noqa: F821
    seed = int(snakemake.params.seed)  # noqa: F821
    source, spec = open_job_source(snakemake)  # noqa: F821
    out_dir = Path(snakemake.output.contributions).parent  # noqa: F821
    private = bool(snakemake.params.contribution_stats_private)  # noqa: F821
    batch_rows = int(snakemake.params.untracked["tokenizer"]["batch_rows"])  # noqa: F821
    stats = prepare_dataset(source, name, spec, out_dir, seed, batch_rows=batch_rows, private_stats=private)
    if private:  # only the public sizes (userdp.data.prepare.public_view)
        log.info("dataset %s: users %s", name, stats["n_users"])
    else:
        log.info("dataset %s: users %s, examples %s, median/max train contributions %s/%s, dropped %s",
                 name, stats["n_users"], stats["n_examples"], stats["median_train"], stats["max_train"], stats["dropped"])


userdp.errors.run_main(main, log)
