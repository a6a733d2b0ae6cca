"""Benchmark: the accountant memo (userdp.privacy.memo) on the epsilons one cell of the study recomputes.

One ELS cell of config/study.yaml's kind (q = 2.1e-4, T = 50, G = 8, one
calibrated sigma) and one ULS cell: each run's ledger recomputes the epsilon of
T steps and learning-rate selection that of the 2 runs composed (2T steps).
In one process, with every in-process cache cleared before each call:

* fresh: `accounting.epsilon` without the memo (what every job did before);
* memo hit: the same call with the memo holding the result (what every job
  after the plan's does in the pipeline).

Prints seconds of each, the ratio fresh / hit, and that the numbers are equal.

    .venv/bin/python benchmarks/bench_memo.py
"""

from __future__ import annotations

import os
import tempfile
import time

from userdp.privacy import accounting, memo
from userdp.privacy.mechanism import ELS, ULS, compose


def clear() -> None:
    for f in (accounting._composed_step_pld, accounting._fixed_pld):
        f.cache_clear()


def timed(fn):
    clear()
    t = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t


def main() -> None:
    cells = {
        "ELS G=8, ledger (T steps)": ELS(0.000212249, 50, 8).dp_event(0.3664),
        "ELS G=8, selection (2 runs)": compose([ELS(0.000212249, 50, 8).dp_event(0.3664)] * 2),
        "ULS, ledger (T steps)": ULS(0.0200891, 50, 1).dp_event(1.121),
    }
    delta = 1e-6
    print(f"{'computation':30s} {'fresh s':>9s} {'hit s':>9s} {'ratio':>8s}  equal")
    with tempfile.TemporaryDirectory() as d:
        for name, event in cells.items():
            os.environ.pop(memo.ENV, None)
            fresh, t_fresh = timed(lambda: accounting.epsilon(event, delta))
            os.environ[memo.ENV] = d
            accounting.epsilon(event, delta)  # the first job (the plan) stores it
            hit, t_hit = timed(lambda: accounting.epsilon(event, delta))
            print(f"{name:30s} {t_fresh:9.3f} {t_hit:9.4f} {t_fresh / t_hit:8.0f}  {fresh == hit}")
    os.environ.pop(memo.ENV, None)


if __name__ == "__main__":
    main()
