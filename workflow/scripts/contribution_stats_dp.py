"""Snakemake script (rule contribution_stats_dp): the DP histogram of train users' counts."""

import userdp.errors
import userdp.io
import userdp.logutil
from userdp.privacy.contribution_stats import release_for_dataset
from userdp.privacy.planner import read_counts

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    inputs = {k: str(v) for k, v in sm.input.items()}
    counts, source = read_counts(users=inputs.get("users"), tokens=inputs.get("tokens"))
    record = release_for_dataset(counts, dict(sm.params.settings), int(sm.params.seed),
                                 dataset=sm.wildcards.dataset, source=source, secret=bool(sm.params.secret))
    userdp.io.write_json(sm.output[0], record)
    log.info("%s: %d bins, epsilon %g (Laplace scale %g), counts from %s", sm.output[0], len(record["noisy_counts"]),
             record["epsilon"], record["noise_scale"], source)


userdp.errors.run_main(main, log)
