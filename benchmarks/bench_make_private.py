"""Benchmark: a `make_private` step (PrivateTraining.step) against the engine's step, same model and batches.

Two copies of one model, one pool, one plan and the same seeds, so both sample the same units at every step:

- engine: `engine.setup` with the pipeline's optimizer (training.optimizer adam) and `Run.advance`, the step
  body `engine.train`'s loop runs;
- make_private: `PrivateTraining` around a caller's `torch.optim.Adam` (the same optimizer), `step()`: the
  refusal checks (optimizer, device, trainable set, gradients present) + the same `Run.advance` + clearing
  p.grad.

Steps are interleaved (engine, make_private, engine, ...) so machine noise hits both alike; the script prints
the median step time of each and their ratio (the issue's bar: at most 1.05x). Example:

    .venv/bin/python benchmarks/bench_make_private.py                 # ELS and ULS, the default shape
    .venv/bin/python benchmarks/bench_make_private.py --steps 60 --n-embd 256 --lora 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import pyarrow as pa
import torch


def tokens(n_users: int, seq: int, vocab: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    counts = np.maximum(1, np.round(rng.lognormal(np.log(4), 1.0, n_users))).astype(int)
    users, ids = [], []
    for u, c in enumerate(counts):
        for _ in range(c):
            n = int(rng.integers(seq // 2, seq + 1))
            users.append(f"u{u:05d}")
            ids.append([1] + rng.integers(4, vocab, size=n - 2).tolist() + [2])
    return pa.table({"user_id": pa.array(users), "example_id": pa.array(np.arange(len(users)), pa.int64()),
                     "input_ids": pa.array(ids, pa.list_(pa.int32()))})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="els,uls")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each (after 3 warm-up steps)")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64, help="expected examples per step")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import userdp
    from userdp.training import engine, models, run_seeds
    from userdp.training.pool import build_pool
    from userdp.training.private import PrivateTraining
    from userdp.training.settings import TrainSettings

    table = tokens(args.users, args.seq, args.vocab)
    counts = np.unique(np.asarray(table["user_id"].to_pylist()), return_counts=True)[1]
    cfg = {"architecture": "gpt2", "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": 4,
           "tie_embeddings": True}
    base = models.build_model(cfg, args.vocab, args.seq, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
                              seed=0)
    if args.lora:
        base = models.apply_lora(base, {"r": args.lora, "alpha": 2 * args.lora, "dropout": 0.0}, seed=0)
    print(f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters, "
          f"{sum(p.numel() for p in base.parameters() if p.requires_grad) / 1e6:.3f}M trainable; "
          f"{args.steps} timed steps each, interleaved, {args.threads} thread(s)")
    total = args.steps + 3
    for method in args.methods.split(","):
        spec = userdp.plan(method, 4.0, counts=counts, compute=args.batch * total, steps=total, group_size=8)
        pool = build_pool(table, spec.group_size, seed=0)
        settings = TrainSettings(learning_rate=1e-3, physical_batch_size=max(64, spec.group_size),
                                 sequence_length=args.seq, device="cpu", log_every_s=1e9)
        seeds = run_seeds.run_seeds(0, 0, "bench", method, "4", args.batch * total, spec.group_size, 1e-3)
        model_a, model_b = copy.deepcopy(base), copy.deepcopy(base)
        run = engine.setup(model_a, pool, spec, settings, None, seeds, 0)
        dp = PrivateTraining(model_b, torch.optim.Adam([p for p in model_b.parameters() if p.requires_grad],
                                                       lr=1e-3), pool, spec, settings, seeds, 0)
        times: dict[str, list[float]] = {"engine": [], "make_private": []}
        for t in range(total):
            for name, fn in (("engine", run.advance), ("make_private", dp.step)):
                t0 = time.perf_counter()
                fn()
                if t >= 3:
                    times[name].append(time.perf_counter() - t0)
        same = all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{method}: engine {med['engine'] * 1e3:.1f} ms, make_private {med['make_private'] * 1e3:.1f} ms "
              f"per step: ratio {med['make_private'] / med['engine']:.3f}x (same weights after the run: {same})")


if __name__ == "__main__":
    main()
