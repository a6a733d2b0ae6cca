"""Power table of the white-box mechanism audit: mutation x size -> empirical bound, claimed epsilon, caught or not.

Each deliberate bug of tests/mechanism_mutations.py is applied to the real
engine (or the accounting path) for one audited run
(`userdp.evaluation.mechanism_audit.audit_cell`), at each canary count and
target epsilon, next to the honest mechanism at the same seeds. "caught"
means the empirical user-level epsilon lower bound (95%) exceeds the claimed
epsilon; "check" says whether the audit's exact noise / divisor checks
failed (they are not an epsilon bound). The 2-process mutation runs in two
gloo processes (torch.multiprocessing). A last block simulates (numpy, no
engine) the noise-halved mechanism at canary counts too large for the engine
on a CPU, to show where the one-run bound would catch it.

    PYTHONPATH=workflow .venv/bin/python benchmarks/mechanism_audit_power.py [--quick]

Prints a Markdown table (docs/audits.md, "White-box audit of the mechanism").
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mechanism_mutations as mm
from userdp.evaluation import mechanism_audit as ma

FULL = dict(group_size=4, sampling_rate=1.0, steps=4, delta=1e-6, clip_norm=1e-3, other_users=50,
            physical_batch_size=256)
SMALL_Q = dict(group_size=1, sampling_rate=0.005, steps=400, delta=1e-6, clip_norm=1e-3, other_users=0,
               physical_batch_size=256)
#: (mutation, method, regime, size): each row of the table, at every canary count and epsilon.
GRID = [
    ("honest", "uls", "q=1", FULL), ("honest", "els", "q=1", FULL), ("honest", "uls", "q=0.005", SMALL_Q),
    ("noise_halved", "uls", "q=1", FULL), ("noise_halved", "els", "q=1", FULL),
    ("clipping_skipped_for_one_unit", "uls", "q=1", FULL),
    ("clipping_skipped_for_one_unit", "uls", "q=0.005", SMALL_Q),
    ("accounting_rate_smaller", "uls", "q=1", FULL), ("accounting_rate_smaller", "els", "q=1", FULL),
    ("els_accounted_with_g1", "els", "q=1", FULL),
    ("divide_by_realised_size", "uls", "q=0.005", SMALL_Q),
]


def one(mutation: str, s: ma.CellSetup) -> tuple[dict, float]:
    t = time.perf_counter()
    with mm.MUTATIONS[mutation]():
        row = ma.audit_cell(s)
    return row, time.perf_counter() - t


def _two_process_worker(rank: int, root: str, cells: list) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=mm.WORLD)
    try:
        from userdp.training import distributed

        ctx = distributed.current_context()
        rows = []
        for name, kw in cells:
            t = time.perf_counter()
            with mm.MUTATIONS[name]():
                row = ma.audit_cell(ma.CellSetup(**kw), dist=ctx)
            rows.append((name, row, time.perf_counter() - t))
        if rank == 0:
            torch.save(rows, f"{root}/rows.pt")
    finally:
        dist.destroy_process_group()


def _fdp(r: dict) -> str:
    """The f-DP bound and its ceiling (only where each canary's release is exactly Gaussian, q = 1)."""
    if np.isnan(r["epsilon_lower_bound_fdp"]):
        return "- | -"
    return f"{r['epsilon_lower_bound_fdp']:.3f} | {r['epsilon_lower_bound_fdp_ceiling']:.3f}"


def fmt_row(mutation: str, regime: str, r: dict, seconds: float) -> str:
    caught = "**yes**" if r["bound_exceeds_claim"] else "no"
    check = "failed" if r["noise_check_failed"] else "ok"
    return (f"| {mutation} | {r['method'].upper()} | {regime} | {r['processes']} | {r['canaries']} | "
            f"{r['epsilon_claimed']:.3f} | {r['noise_multiplier']:.3f} | {r['epsilon_lower_bound']:.3f} | "
            f"{r['epsilon_lower_bound_ceiling']:.3f} | {_fdp(r)} | {caught} | {r['noise_std_ratio']:.3f} | "
            f"{r['divisor_ratio_min']:.2f}-{r['divisor_ratio_max']:.2f} | {check} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one canary count (1000) and epsilon 2 only")
    p.add_argument("--fdp", action="store_true",
                   help="the q = 1 rows at 3,000 canaries and claimed epsilon 2 and 4, where the f-DP bound applies")
    args = p.parse_args()
    torch.set_num_threads(1)
    canaries = [1000] if args.quick else [3000] if args.fdp else [500, 1000, 2000]
    epsilons = [2.0] if args.quick else [2.0, 4.0] if args.fdp else [1.0, 2.0]
    grid = [g for g in GRID if g[2] == "q=1"] if args.fdp else GRID
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
          f"`{' '.join(['python', 'benchmarks/mechanism_audit_power.py', *sys.argv[1:]])}`; confidence 0.95, "
          "delta 1e-6, guess fractions 0.05/0.1/0.2/0.5 x 2 scores (16 guess sets; x 2 estimators where q = 1: "
          "32), seed 0.\n")
    print("| mutation | method | sampling | processes | canaries | claimed eps | sigma | empirical eps (95%) | "
          "ceiling | f-DP eps (95%) | f-DP ceiling | caught | noise std ratio | divisor ratio | exact checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in canaries:
        for eps in epsilons:
            for mutation, method, regime, size in grid:
                s = ma.CellSetup(method=method, epsilon=eps, canaries=m, **size)
                r, sec = one(mutation, s)
                print(fmt_row(mutation, regime, r, sec), flush=True)
    # (e) noise on every rank: two gloo processes
    cells = [(name, dict(method="uls", epsilon=eps, canaries=m, processes=2, **{**FULL, "physical_batch_size": 64}))
             for m in canaries for eps in epsilons for name in ("honest", "noise_on_every_rank")]
    with tempfile.TemporaryDirectory() as root:
        torch.multiprocessing.spawn(_two_process_worker, args=(root, cells), nprocs=mm.WORLD, join=True)
        for name, r, sec in torch.load(os.path.join(root, "rows.pt"), weights_only=False):
            print(fmt_row(name, "q=1", r, sec), flush=True)
    if args.fdp:
        return
    # Simulation (numpy): the noise-halved ULS mechanism (q = 1, T = 4) at canary counts beyond the engine's reach
    print("\nSimulation without the engine (numpy draws of the released canary projections, the same scores "
          "and bound), noise halved, ULS q = 1, T = 4, 5 seeds each:\n")
    print("| canaries | claimed eps | empirical eps, honest (mean) | empirical eps, noise halved (min-max) | "
          "ceiling | caught (seeds) |")
    print("|---|---|---|---|---|---|")
    for m in ([20000] if args.quick else [5000, 20000, 50000]):
        for eps in ([1.0] if args.quick else [0.5, 1.0, 2.0]):
            s = ma.CellSetup("uls", eps, m, 1, 1.0, 4, 1e-6, 1.0, guess_fractions=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5))
            c = ma.calibrate_cell(s)
            honest, bad = [], []
            for seed in range(5):
                for scale, out in ((1.0, honest), (0.5, bad)):
                    sc, inc = ma.simulate_scores(s, c["noise_multiplier"], np.random.default_rng(seed),
                                                 noise_scale=scale)
                    res = ma.audit_bound(sc, inc, delta=s.delta, confidence=0.95, guess_fractions=s.guess_fractions,
                                         )
                    out.append(res["epsilon_lower_bound"])
            print(f"| {m} | {c['epsilon_claimed']:.3f} | {np.mean(honest):.3f} | {min(bad):.3f}-{max(bad):.3f} | "
                  f"{res['epsilon_lower_bound_ceiling']:.3f} | {sum(b > c['epsilon_claimed'] for b in bad)}/5 |",
                  flush=True)


if __name__ == "__main__":
    main()
