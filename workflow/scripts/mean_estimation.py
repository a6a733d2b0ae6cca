"""Run the synthetic mean-estimation study (thin adapter).

Inputs: the calibration table. Outputs: results.parquet (one row per
method, epsilon, budget, diversity, G, seed) and lr_sweep.parquet (every
learning rate, tuning and report seeds).
"""

import time

from threadpoolctl import threadpool_limits

from userdp.errors import run_main
from userdp.experiments import mean_estimation as me
from userdp.io import read_frame, write_parquet
from userdp.logutil import Progress, setup_logging


log = setup_logging(snakemake.log[0])


def main() -> None:
    p = snakemake.params
    spec = me.MeanEstimationSpec.from_config({"mean_estimation": dict(p.mean_estimation), "seed": p.seed,
                                              "privacy": {"delta_exponent": p.delta_exponent}})
    calibration = read_frame(snakemake.input.calibration)
    progress = Progress(log, None, "mean-estimation runs", every_s=5.0)
    start = time.monotonic()
    # Thousands of tiny matrix products: one BLAS thread is much faster than many competing ones
    # (OpenBLAS splits each product over every core, and next to other jobs its threads wait on each other).
    with threadpool_limits(limits=1, user_api="blas"):
        results, sweep = me.run_study(spec, calibration, progress=lambda done, total: progress.update(
            1, extra=f"of {total}"))
    log.info("simulated %d rows in %.1fs", len(sweep), time.monotonic() - start)
    ratios = me.uls_over_els(results)
    log.info("mean error ULS (best G) / ELS (G = median) per cell (< 1: ULS better):\n%s",
             ratios.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    write_parquet(snakemake.output.sweep, sweep)
    write_parquet(snakemake.output.results, results)


run_main(main, log)
