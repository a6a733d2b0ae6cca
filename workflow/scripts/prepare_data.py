"""Snakemake script (rule prepare_data): clean, group users, split, contribution statistics."""

from pathlib import Path

import pyarrow as pa

import userdp.errors
import userdp.logutil
from userdp.data.sources import open_job_source
from userdp.data.prepare import prepare_dataset
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    pa.set_cpu_count(max(1, int(snakemake.threads)))
    name = snakemake.wildcards.dataset
    seed = int(snakemake.params.seed)
    source, spec = open_job_source(snakemake)
    out_dir = Path(snakemake.output.contributions).parent
    private = bool(snakemake.params.contribution_stats_private)
    batch_rows = int(untracked(snakemake.config, "tokenizer.batch_rows")["tokenizer"]["batch_rows"])
    stats = prepare_dataset(source, name, spec, out_dir, seed, batch_rows=batch_rows, private_stats=private)
    if private:  # only the public sizes (userdp.data.prepare.public_view)
        log.info("dataset %s: users %s", name, stats["n_users"])
    else:
        log.info("dataset %s: users %s, examples %s, median/max train contributions %s/%s, dropped %s",
                 name, stats["n_users"], stats["n_examples"], stats["median_train"], stats["max_train"], stats["dropped"])


userdp.errors.run_main(main, log)
