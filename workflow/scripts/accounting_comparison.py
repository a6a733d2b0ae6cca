"""Snakemake script (rule accounting_comparison): sigma needed per (G, epsilon) per accountant."""

import userdp.errors
import userdp.io
import userdp.logutil
from userdp.privacy.comparison import noise_vs_group_size

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    c = sm.params.comparison
    df = noise_vs_group_size(
        float(c["sampling_rate"]),
        int(c["steps"]),
        float(c["delta"]),
        [float(e) for e in c["epsilons"]],
        [int(g) for g in c["group_sizes"]],
        tolerance=float(sm.params.tolerance),
        max_noise_multiplier=float(sm.params.max_noise_multiplier),
    )
    userdp.io.write_parquet(sm.output[0], df)
    log.info("wrote %s (%d rows, %.1f s of calibration)", sm.output[0], len(df), df["seconds"].sum())


userdp.errors.run_main(main, log)
