"""Snakemake script (rule download_data): fetch a dataset's remote files, write a marker.

Embedded and local sources have nothing to fetch; the marker then only
records the spec. This rule is a localrule: on a cluster it runs on the
submit host, which usually is the one with internet access.
"""

import platform
import time

import userdp.errors
import userdp.logutil
from userdp.data.sources import open_job_source
from userdp.io import write_json

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    name = snakemake.wildcards.dataset
    source, spec = open_job_source(snakemake)
    start = time.monotonic()
    source.download()
    log.info("dataset %s (source %s): download step done in %.1fs", name, spec.get("source"), time.monotonic() - start)
    write_json(snakemake.output[0], {"dataset": name, "spec": spec, "host": platform.node(),
                                     "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})


userdp.errors.run_main(main, log)
