"""GPU smoke run: short real DP fine-tuning (ELS, ULS, ULS with adaptive clipping, ULS as 4-banded DP-FTRL,
non-private) through
userdp.training.engine.train.

Not a test (never run by pytest or CI): benchmarks/gpu_check.sh runs it on a
GPU machine. It exercises the whole training loop as the `finetune` rule
does (Poisson sampling, micro-batch packing, per-unit clipping, noise,
division by the expected batch, Adam, ledger, final model save) on a
gpt2-medium-sized model built from config (random init: speed and memory do
not depend on the weights) and a synthetic tokens table, and reports:

- seconds per step (median over the steps after `--warmup-steps`), steps/s
  and examples/s (realised examples over the same steps);
- peak GPU memory (torch.cuda.max_memory_allocated / max_memory_reserved);
- the ledger, and checks: loss finite; with the real accountant
  (dp-accounting importable), the ledger's recomputed epsilon equals the
  calibrated epsilon_achieved and is <= the target.

Without dp-accounting (the GPU image lacks it unless its wheel is carried)
the plan uses a fixed sigma and the ledger's epsilon is NaN ("accountant":
"unavailable"); the timings are unaffected.

The non-private run samples like the ELS run (same pool, same rate; no
clipping, no noise) and the ULS run's user rate is set for the same expected
examples per step, so `ratios_vs_nonprivate` (examples/s) is the cost of DP
in the real loop, the figure benchmarks/gpu_hours.py --measured uses.

    python3 benchmarks/gpu_finetune_smoke.py --device cuda --bf16 --json-out $OUT/gpu_finetune_smoke.json
    .venv/bin/python benchmarks/gpu_finetune_smoke.py --size tiny --device cpu --steps 2   # CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

log = logging.getLogger("gpu_finetune_smoke")

# name: (n_layer, n_embd, n_head, vocab, seq_len, physical batch, expected examples per step, train users)
SIZES = {
    # the paper's model shape and micro-batch (config/paper.yaml)
    "gpt2-medium": (24, 1024, 16, 50257, 128, 64, 512, 4000),
    # CPU dry run of the same code path
    "tiny": (2, 64, 4, 512, 32, 16, 32, 300),
}
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PAD = IDS["pad_token_id"]


def tokens_table(n_users: int, vocab: int, seq: int, seed: int) -> pa.Table:
    """A tokens.parquet-shaped train table: heavy-tailed examples per user (median ~6), varied lengths."""
    rng = np.random.default_rng(seed)
    counts = np.clip(np.round(rng.lognormal(np.log(6.0), 1.0, n_users)), 1, 300).astype(np.int64)
    n = int(counts.sum())
    lengths = np.clip(np.round(rng.lognormal(np.log(0.6 * seq), 0.5, n)), 4, seq).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(3, vocab, size=int(lengths.sum()), dtype=np.int32)
    users = np.repeat(np.array([f"u{u:06d}" for u in range(n_users)]), counts)
    return pa.table({
        "user_id": pa.array(users, pa.string()),
        "example_id": pa.array(np.arange(n, dtype=np.int64)),
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
    })


def accountant() -> tuple[Callable[..., Any] | None, str]:
    """(calibrate, version) of the real accountant, or (None, reason) when dp-accounting is missing."""
    try:
        import dp_accounting

        from userdp.privacy.calibration import calibrate
    except ImportError as exc:
        return None, f"unavailable ({exc})"
    from importlib import metadata

    try:
        version = metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return calibrate, f"dp-accounting {version} from {Path(dp_accounting.__file__).parent}"


def nan_epsilon(*args: Any, **kwargs: Any) -> float:
    """Ledger stand-in when dp-accounting is missing: epsilon is not computed."""
    return math.nan


#: The bands of the uls_banded run (banded DP-FTRL, userdp.privacy.banded).
BANDS = 4


def make_plan(method: str, pool: Any, expected: float, steps: int, epsilon: float, delta: float,
              calibrate: Callable[..., Any] | None, fixed_sigma: float, count_noise: float = 0.05
              ) -> tuple[dict[str, Any], float]:
    """A hand-built plan (the plan.json fields the engine and ledger read); returns (plan, calibration seconds)."""
    private = method != "nonprivate"
    mech = "els" if method == "nonprivate" else method.split("_")[0]  # els, uls, *_adaptive, uls_banded
    n = pool.n_examples if mech == "els" else pool.n_users
    bands = BANDS if method == "uls_banded" else 1  # privacy.correlated_noise: {bands: BANDS}
    q = expected / n * bands
    if q > 1:
        raise SystemExit(f"{method}: sampling rate {q:.3g} > 1; use more users (--n-users) or fewer examples per step")
    sigma, eps_ach, acct, seconds = 0.0, math.inf, None, 0.0
    if private and calibrate is not None:
        t0 = time.perf_counter()
        from userdp.privacy import mechanism

        mechanism_of = (lambda *a: mechanism.BandedULS(*a, bands=bands)) if bands > 1 else mechanism.get(mech)
        cal = calibrate(mechanism_of(q, steps, pool.group_size), epsilon, delta)
        seconds = time.perf_counter() - t0
        sigma, eps_ach, acct = cal.noise_multiplier, cal.epsilon_achieved, cal.accountant
    elif private:
        sigma, eps_ach, acct = fixed_sigma, None, "unavailable"
    plan = {
        "method": mech, "epsilon": epsilon if private else math.inf, "delta": delta, "group_size": pool.group_size,
        "sampling_rate": q, "steps": steps, "expected_batch": expected, "noise_multiplier": sigma,
        "epsilon_achieved": eps_ach, "compute_budget": None, "accountant": acct,
        "clip_norm": 1.0 if private else None, "clipping": "flat",
    }
    if bands > 1:
        plan["correlated_noise"] = {"bands": bands}
    if method.endswith("_adaptive"):  # privacy.clipping: adaptive, the default privacy.adaptive but count_noise
        plan.update(clipping="adaptive", adaptive_clipping={"quantile": 0.5, "learning_rate": 0.2,
                                                             "count_noise": count_noise})
    from userdp.privacy.spec import RunSpec

    # validated like a plan file, its dp_event computed (a plan needs dp-accounting, even at a fixed sigma)
    return RunSpec(dataset="gpu-smoke", **plan).to_record(), seconds


def summarise(frame: Any, warmup: int) -> dict[str, Any]:
    """Step-time figures from the train log, leaving out the first `warmup` steps (kernel selection, caches)."""
    steady = frame.iloc[warmup:] if len(frame) > warmup else frame
    secs = steady["seconds"].to_numpy(dtype=float)
    ex = steady["realised_examples"].to_numpy(dtype=float)
    med = float(statistics.median(secs))
    return {
        "steps_timed": int(len(steady)),
        "median_step_s": med,
        "mean_step_s": float(secs.mean()),
        "first_step_s": float(frame["seconds"].iloc[0]),
        "steps_per_s": 1.0 / med if med > 0 else math.nan,
        "examples_per_s": float(ex.sum() / secs.sum()) if secs.sum() > 0 else math.nan,
        "mean_realised_examples": float(frame["realised_examples"].mean()),
        "mean_realised_units": float(frame["realised_units"].mean()),
        "loss_first": float(frame["loss"].iloc[0]),
        "loss_last": float(frame["loss"].iloc[-1]),
        "mean_clipped_fraction": float(frame["clipped_fraction"].mean()),
    }


def run_one(method: str, args: argparse.Namespace, train: pa.Table, calibrate: Callable[..., Any] | None,
            n_train_users: int) -> dict[str, Any]:
    """Build a fresh model and pool, train `args.steps` steps of `method`, return its figures."""
    from userdp.training import engine, run_seeds, run_state
    from userdp.training.models import build_model
    from userdp.training.pool import build_pool
    from userdp.training.settings import TrainSettings

    n_layer, n_embd, n_head, vocab, seq, batch, expected_ex, _ = SIZES[args.size]
    batch = args.physical_batch or batch
    expected_ex = args.expected_examples or expected_ex
    uls = method.startswith("uls")
    G = args.uls_group_size if uls else args.els_group_size
    pool = build_pool(train, G, seed=7)
    # ULS: expected users per step so that expected examples per step match ELS (as the planner does)
    expected = expected_ex if not uls else expected_ex / (pool.n_examples / pool.n_users)
    # userdp.privacy.planner.default_delta (1 / N^1.1), inlined: the planner imports dp-accounting
    delta = 1.0 / float(n_train_users) ** 1.1
    plan, cal_s = make_plan(method, pool, expected, args.steps, args.epsilon, delta, calibrate, args.fixed_sigma,
                            args.count_noise)
    settings = TrainSettings(
        learning_rate=1e-4, optimizer="adam", schedule="constant", warmup_steps=0, physical_batch_size=batch,
        sequence_length=seq, checkpoint_every=10**9, device=args.device,
        precision="bf16" if args.bf16 else "fp32", log_every_s=5.0,
    )
    seeds = run_seeds.run_seeds(0, 0, "smoke", method, str(args.epsilon), expected_ex * args.steps, G)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        mem_before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    # initialise on the device itself (a 355M-parameter init on the CPU alone takes seconds)
    with torch.device(args.device):
        model = build_model({"architecture": "gpt2", "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head,
                             "tie_embeddings": True}, vocab, seq, IDS, seed=11)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    run_dir = Path(args.run_root) / method
    shutil.rmtree(run_dir, ignore_errors=True)
    log.info("%s: %.1fM params, G=%d, pool %d examples / %d users, q=%.4g, expected %.1f %s/step, sigma=%.4g",
             method, n_params / 1e6, G, pool.n_examples, pool.n_users, plan["sampling_rate"], expected,
             "users" if uls else "examples", plan["noise_multiplier"])
    t0 = time.perf_counter()
    out = engine.train(model, pool, plan, settings, run_state.RunPaths(run_dir), seeds, PAD,
                       compute_epsilon=None if calibrate is not None else nan_epsilon)
    if args.device == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "method": method, "n_params": n_params, "group_size": G, "pool_examples": pool.n_examples,
        "pool_users": pool.n_users, "expected_units_per_step": expected, "expected_examples_per_step": expected_ex,
        "physical_batch_size": batch, "sequence_length": seq, "precision": settings.precision,
        "model_build_s": build_s, "calibration_s": cal_s, "train_call_s": train_s,
        # what the loop's steps do not cover: ledger (accountant call) and the final model save
        "outside_steps_s": train_s - float(out.log["seconds"].sum()),
        **summarise(out.log, args.warmup_steps),
    }
    if args.device == "cuda":
        result["peak_gpu_mem_mb"] = (torch.cuda.max_memory_allocated() - mem_before) / 2**20
        result["peak_gpu_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    result["host_max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ledger = out.ledger or {}
    result["ledger"] = {k: v for k, v in ledger.items() if k not in ("training", "seeds")}
    sampled = out.log["realised_examples"] > 0  # a step that sampled no one has no loss (NaN)
    checks = {"complete": bool(out.complete), "loss_finite": bool(np.isfinite(out.log["loss"][sampled]).all())}
    if method != "nonprivate" and calibrate is not None:
        eps, ach = float(ledger["epsilon"]), float(plan["epsilon_achieved"])
        checks["ledger_epsilon_matches_plan"] = abs(eps - ach) <= 1e-6 * max(1.0, ach)
        checks["ledger_epsilon_within_target"] = eps <= args.epsilon * (1 + 1e-3)
    result["checks"] = checks
    log.info("%s: median step %.3fs (%.2f steps/s), %.0f examples/s, peak GPU mem %s MB, epsilon %s, checks %s",
             method, result["median_step_s"], result["steps_per_s"], result["examples_per_s"],
             f"{result.get('peak_gpu_mem_mb', float('nan')):.0f}", ledger.get("epsilon"), checks)
    del model, out
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(run_dir, ignore_errors=True)  # the saved model is ~1.4 GB at gpt2-medium size
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2-medium", choices=sorted(SIZES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--bf16", action="store_true", help="training.precision bf16 (autocast; CUDA only)")
    ap.add_argument("--methods", default="els,uls,uls_adaptive,uls_banded,nonprivate",
                    help="comma list of els, uls, els_adaptive, uls_adaptive (privacy.clipping: adaptive), uls_banded "
                         f"(privacy.correlated_noise: {{bands: {BANDS}}}), nonprivate")
    ap.add_argument("--count-noise", type=float, default=0.05,
                    help="privacy.adaptive.count_noise of the *_adaptive runs (std of the noisy unclipped fraction)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the step-time figures")
    ap.add_argument("--expected-examples", type=int, default=None, help="expected examples per step (size default)")
    ap.add_argument("--physical-batch", type=int, default=None)
    ap.add_argument("--n-users", type=int, default=None, help="train users of the synthetic table")
    ap.add_argument("--els-group-size", type=int, default=6, help="G for ELS (about the median count)")
    ap.add_argument("--uls-group-size", type=int, default=16, help="G for ULS")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--fixed-sigma", type=float, default=1.0, help="sigma when dp-accounting is missing")
    ap.add_argument("--threads", type=int, default=8, help="torch CPU threads")
    ap.add_argument("--run-root", default="/tmp/userdp_gpu_smoke", help="scratch folder for the runs' outputs")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("--device cuda but torch sees no GPU")
        return 2
    if args.bf16 and args.device != "cuda":
        log.warning("--bf16 applies on CUDA only; the CPU run is fp32 (as in the pipeline)")
    torch.set_num_threads(args.threads)
    from userdp.io import write_json

    calibrate, acct = accountant()
    log.info("accountant: %s", acct)
    n_users = args.n_users or SIZES[args.size][7]
    vocab, seq = SIZES[args.size][3], SIZES[args.size][4]
    train = tokens_table(n_users, vocab, seq, seed=3)
    summary: dict[str, Any] = {
        "size": args.size, "shape": dict(zip(("n_layer", "n_embd", "n_head", "vocab", "seq", "physical_batch",
                                              "expected_examples", "n_users"), SIZES[args.size])),
        "device": args.device, "bf16": args.bf16, "steps": args.steps, "warmup_steps": args.warmup_steps,
        "epsilon_target": args.epsilon, "accountant": acct, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "train_examples": train.num_rows, "train_users": n_users, "runs": {},
    }
    ok = True
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        try:
            res = run_one(method, args, train, calibrate, n_users)
            ok &= all(res["checks"].values())
        except Exception as exc:  # record and go on: the other methods' figures are still wanted
            log.exception("%s run failed", method)
            res, ok = {"method": method, "error": f"{type(exc).__name__}: {exc}"}, False
        summary["runs"][method] = res
        if args.json_out:  # after every run, so a timeout still leaves the finished runs' figures
            write_json(args.json_out, summary)
    runs = summary["runs"]
    base = runs.get("nonprivate", {}).get("median_step_s")
    if base:
        summary["ratios_vs_nonprivate"] = {
            m: {"step": r["median_step_s"] / base,
                "examples_per_s": r["examples_per_s"] / runs["nonprivate"]["examples_per_s"]}
            for m, r in runs.items() if m != "nonprivate" and "median_step_s" in r
        }
    summary["ok"] = ok
    if args.json_out:
        write_json(args.json_out, summary)
    print("\n== fine-tuning smoke (%s, %s%s, %d steps)" % (args.size, args.device, " bf16" if args.bf16 else "",
                                                           args.steps))
    for m, r in runs.items():
        if "error" in r:
            print(f"{m:>10s}: FAILED {r['error']}")
            continue
        mem = f"{r['peak_gpu_mem_mb']:8.0f} MB" if "peak_gpu_mem_mb" in r else "   (cpu)"
        ratio = summary.get("ratios_vs_nonprivate", {}).get(m, {}).get("step")
        print(f"{m:>10s}: {r['median_step_s'] * 1e3:8.1f} ms/step  {r['steps_per_s']:6.2f} steps/s  "
              f"{r['examples_per_s']:8.1f} examples/s  peak mem {mem}  "
              f"step ratio {ratio if ratio is None else round(ratio, 3)}  eps {r['ledger'].get('epsilon')}  "
              f"checks {'ok' if all(r['checks'].values()) else r['checks']}")
    print("SMOKE " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
