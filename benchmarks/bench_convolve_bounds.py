"""Benchmark: the mean-estimation calibration of a config with dp-accounting's self-convolution bounds and ours.

`userdp.privacy.accounting._self_convolve_bounds` gives the same integers as dp-accounting's
`compute_self_convolve_bounds` (tests/test_privacy_accounting.py); this measures what it saves on the
calibrations the default pipeline runs (rule mean_estimation_calibration), one process, caches cleared
before each pass, the two passes alternated --repeats times. Prints CPU seconds per pass, the ratio
ours / dp-accounting's, and whether every noise multiplier is identical.

    .venv/bin/python benchmarks/bench_convolve_bounds.py [--configfile config/config.yaml] [--cells 12]
"""

from __future__ import annotations

import argparse
import time

import yaml
from dp_accounting.pld import common as pld_common

from userdp.config import validate_config
from userdp.experiments import mean_estimation as me
from userdp.privacy import accounting


def one_pass(plan, bounds) -> tuple[float, list[float]]:
    accounting._self_convolve_bounds = bounds
    accounting._composed_step_pld.cache_clear()
    start = time.process_time()
    table = me.calibrate_cells(plan, workers=1)
    return time.process_time() - start, [float(x) for x in table["noise_multiplier"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configfile", default="config/config.yaml")
    ap.add_argument("--cells", type=int, default=12, help="the first N rows of the calibration plan (0: all)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    with open(args.configfile) as f:
        config = validate_config(yaml.safe_load(f))
    plan = me.plan_calibrations(me.MeanEstimationSpec.from_config(config))
    if args.cells:
        plan = plan.head(args.cells)
    ours = accounting._self_convolve_bounds
    times = {"dp-accounting": [], "ours": []}
    sigmas = {}
    for _ in range(args.repeats):
        for name, fn in (("dp-accounting", pld_common.compute_self_convolve_bounds), ("ours", ours)):
            t, sigmas[name] = one_pass(plan, fn)
            times[name].append(t)
    accounting._self_convolve_bounds = ours
    base, new = min(times["dp-accounting"]), min(times["ours"])
    print(f"{len(plan)} calibration rows of {args.configfile}: CPU s per pass, best of {args.repeats}")
    print(f"  dp-accounting bounds {base:8.1f}")
    print(f"  ours                 {new:8.1f}   ratio {new / base:.2f}x")
    print(f"  noise multipliers identical: {sigmas['dp-accounting'] == sigmas['ours']}")


if __name__ == "__main__":
    main()
