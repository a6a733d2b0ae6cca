"""Benchmark: coarse-to-fine calibration versus a naive root search, per cell.

For G in --group-sizes and two (q, T) settings, calibrates the ELS noise
multiplier for a target (epsilon, delta) twice, in the same process:

* naive: dp-accounting's own `calibrate_dp_mechanism` (Brent's method) on
  the plain `PLDAccountant` at discretization 1e-4 with the
  `MixtureOfGaussiansDpEvent`, bracket found from [0.5, 1] by doubling, and
  the same relative tolerance (1e-3 of the answer);
* ours: `userdp.privacy.calibration.calibrate` (vectorised MoG PLD,
  capped support, coarse-to-fine levels, certified bracket at 1e-4);
* library levels: the same coarse-to-fine levels and the same accountant
  (`userdp.UserLevelAccountant`), each level's search done by
  `calibrate_dp_mechanism` in log sigma (the way issue 37 asked to try;
  its bar: no calibration slower than ours by more than 1.5x).

Prints seconds per cell, the ratios naive / ours and library levels / ours,
the sigmas and their relative difference. Caches are cleared between cells. The naive search
costs minutes per setting; use --quick for a subset.

    .venv/bin/python benchmarks/bench_calibration.py [--quick] [--no-naive] [--epsilon E]
"""

from __future__ import annotations

import argparse
import math
import time

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from userdp.privacy import accounting, mechanism
from userdp.privacy.accounting import FINE_DISCRETIZATION, UserLevelAccountant
from userdp.privacy.calibration import calibrate, initial_guess, search_levels


def naive_sigma(eps: float, delta: float, q: float, T: int, G: int, rtol: float) -> float:
    def make_event(sigma: float):
        return mechanism.ELS(q, T, G).dp_event(sigma)

    def make_accountant():
        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)

    # A bracket by doubling (as a user would without a good guess); tolerance
    # relative to the lower end of the bracket.
    lo, hi = 0.5, 1.0
    while True:
        e = make_accountant().compose(make_event(hi)).get_epsilon(delta)
        if e <= eps:
            break
        lo, hi = hi, 2 * hi
    return float(
        dp_accounting.calibrate_dp_mechanism(
            make_accountant, make_event, eps, delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=rtol * lo,
        )
    )


def library_levels_sigma(mech: mechanism.Mechanism, eps: float, delta: float, rtol: float) -> float:
    """`calibrate`'s levels (`search_levels`: same discretizations and widths) with `calibrate_dp_mechanism`
    searching each in log sigma, from a bracket just below the previous level's answer (found from the first
    guess by factors of 2 at the first level)."""

    def feasible(u: float, d: float) -> bool:
        return mech.epsilon(math.exp(u), delta, discretization=d) <= eps

    def below(u: float, d: float, step: float) -> float:
        """An infeasible point below u, stepping down by `step`."""
        lo = u - step
        while feasible(lo, d):
            lo -= step
        return lo

    u, step = math.log(initial_guess(mech, eps, delta)), math.log(2.0)  # step: the coarser level's width (or own)
    levels = search_levels(eps, FINE_DISCRETIZATION, rtol)
    for i, (d, width, _) in enumerate(levels):
        tau = math.log1p(width)
        if i == 0 and feasible(u, d):
            lo = below(u, d, step)
            hi = lo + step
        elif i == 0:
            hi = u + step
            while not feasible(hi, d):
                hi += step
            lo = hi - step
        elif i < len(levels) - 1 or feasible(u - tau, d):  # the last level only if the answer is not certified
            lo, hi = below(u, d, max(step, tau)), u
        else:
            continue
        step = tau
        u = float(dp_accounting.calibrate_dp_mechanism(
            lambda: UserLevelAccountant(discretization=d), lambda v: mech.dp_event(math.exp(v)), eps, delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=tau))
    return math.exp(u)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epsilon", type=float, default=4.0)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--group-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--settings", default="0.01:1000,0.05:100", help="q:T pairs")
    ap.add_argument("--quick", action="store_true", help="G in 1,8,64 and the first setting only")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive search (minutes per setting)")
    args = ap.parse_args()
    groups = [int(g) for g in args.group_sizes.split(",")]
    settings = [(float(s.split(":")[0]), int(s.split(":")[1])) for s in args.settings.split(",")]
    if args.quick:
        groups, settings = [1, 8, 64], settings[:1]
    print(f"ELS calibration to epsilon={args.epsilon}, delta={args.delta:g}, relative tolerance 1e-3")
    print(f"{'q':>6} {'T':>5} {'G':>3} {'naive s':>8} {'ours s':>7} {'ratio':>6} {'levels s':>8} {'ratio':>6} "
          f"{'sigma naive':>12} {'sigma ours':>11} {'rel diff':>9} {'sigma levels':>12} {'rel diff':>9}")
    tot_naive = tot_ours = tot_levels = 0.0
    worst = 0.0
    for q, T in settings:
        for G in groups:
            accounting._composed_step_pld.cache_clear()
            t0 = time.perf_counter()
            ours = calibrate(mechanism.ELS(q, T, G), args.epsilon, args.delta)
            t_ours = time.perf_counter() - t0
            accounting._composed_step_pld.cache_clear()
            t0 = time.perf_counter()
            levels = library_levels_sigma(mechanism.ELS(q, T, G), args.epsilon, args.delta, 1e-3)
            t_levels = time.perf_counter() - t0
            t0 = time.perf_counter()
            naive = math.nan if args.no_naive else naive_sigma(args.epsilon, args.delta, q, T, G, 1e-3)
            t_naive = time.perf_counter() - t0
            tot_naive += t_naive
            tot_ours += t_ours
            tot_levels += t_levels
            worst = max(worst, t_levels / t_ours)
            s = ours.noise_multiplier
            print(
                f"{q:>6g} {T:>5d} {G:>3d} {t_naive:>8.2f} {t_ours:>7.2f} {t_naive / t_ours:>6.1f} {t_levels:>8.2f} "
                f"{t_levels / t_ours:>6.2f} {naive:>12.6f} {s:>11.6f} {(s - naive) / naive:>+9.1e} {levels:>12.6f} "
                f"{(s - levels) / levels:>+9.1e}",
                flush=True,
            )
    print(f"total: naive {tot_naive:.1f} s, ours {tot_ours:.1f} s, ratio {tot_naive / tot_ours:.1f}; library levels "
          f"{tot_levels:.1f} s, ratio {tot_levels / tot_ours:.2f}, worst cell {worst:.2f}")


if __name__ == "__main__":
    main()
