"""Calibrate the noise of every distinct mean-estimation cell (thin adapter).

Reads the rule's params (the study keys that change a calibration, and the study's other keys, which the
spec needs but the calibration does not read), writes results/mean_estimation/calibration.parquet.
"""

from userdp.errors import run_main
from userdp.experiments import mean_estimation as me
from userdp.io import write_parquet
from userdp.logutil import setup_logging
from userdp.untracked import untracked

log = setup_logging(snakemake.log[0])


def main() -> None:
    c = snakemake.params.calibration
    # the study's other keys come from the config (no param, so no rerun trigger): the job builds the whole
    # spec but calibrates from the param's keys only
    study = {**untracked(snakemake.config, "mean_estimation")["mean_estimation"], **c["mean_estimation"]}
    spec = me.MeanEstimationSpec.from_config({"mean_estimation": study, "seed": c["seed"],
                                              "privacy": {"delta_exponent": c["delta_exponent"]}})
    plan = me.plan_calibrations(spec)
    log.info("mean estimation: %d (method, epsilon, budget, G) cells, delta = %.3g", len(plan), spec.delta)
    table = me.calibrate_cells(plan, workers=snakemake.threads)
    write_parquet(snakemake.output[0], table)
    log.info("wrote %s", snakemake.output[0])


run_main(main, log)
