"""Benchmark of building the bounded training pool from tokens.parquet: peak memory and time.

Compares, each in a fresh child process (peak RSS = VmHWM of that process):
- baseline: `build_pool(read_train_tokens(path), G, seed)`, which loads every
  train row's tokens before bounding (the in-memory route);
- streamed: `load_train_pool(path, G, seed)` (what fine-tuning jobs use):
  ids first, then the tokens of the kept rows only.
Both must give the same pool; the script checks it (a digest of the arrays).

The synthetic tokens.parquet has Stack Overflow's shape: 8-digit user ids,
heavy-tailed examples per user (log-normal, median 80), ~10% of users in
validation/test, 3-48 tokens per example.

    .venv/bin/python benchmarks/bench_pool.py                # 8 million rows, G = 16
    .venv/bin/python benchmarks/bench_pool.py --n 2000000 --group-size 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_tokens(path: Path, n: int, seed: int) -> int:
    """Write an n-row tokens.parquet; returns the number of users."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    counts = np.maximum(1, rng.lognormal(np.log(80), 1.6, n // 40 + 10).astype(np.int64))
    counts = counts[: int(np.searchsorted(np.cumsum(counts), n)) + 1]
    counts[-1] -= int(counts.sum() - n)
    n_users = len(counts)
    names = pa.array([f"{u * 3 + 1:08d}" for u in range(n_users)])
    user_of_row = np.repeat(np.arange(n_users), counts)
    split_of_user = np.where(rng.random(n_users) < 0.1, 1, 0)
    split_of_user[0] = 0
    splits = pa.array(["train", "test"]).take(pa.array(split_of_user[user_of_row]))
    perm = rng.permutation(n)  # rows not in (user, example id) order, as after chunking/filters
    lengths = rng.integers(3, 49, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = pa.array(rng.integers(4, 4096, int(offsets[-1]), dtype=np.int32))
    ids = pa.ListArray.from_arrays(pa.array(offsets), values)
    table = pa.table({
        "user_id": names.take(pa.array(user_of_row[perm])),
        "example_id": pa.array(perm.astype(np.int64)),
        "split": splits.take(pa.array(perm)),
        "input_ids": ids,
        "n_tokens": pa.array(lengths.astype(np.int32)),
    })
    pq.write_table(table, path, row_group_size=1 << 17)
    return n_users


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, path: Path, group_size: int, seed: int) -> dict:
    from userdp.training import pool

    start = time.perf_counter()
    if mode == "baseline":
        p = pool.build_pool(pool.read_train_tokens(path), group_size, seed)
    else:
        p = pool.load_train_pool(path, group_size, seed)
    seconds = time.perf_counter() - start
    h = hashlib.sha256()
    for a in (p.user_offsets, p.example_ids, p.example_user, p.token_values, p.token_offsets):
        h.update(a.tobytes())
    h.update("\n".join(p.user_ids).encode())
    return {"mode": mode, "seconds": seconds, "peak_rss_mb": peak_rss_mb(), "digest": h.hexdigest(),
            "pool_rows": p.n_examples, "train_rows": p.n_examples_before_bounding, "users": p.n_users,
            "pool_token_mb": p.token_values.nbytes / 2**20}


def run_child(mode: str, path: Path, group_size: int, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--path", str(path), "--group-size", str(group_size),
           "--seed", str(seed)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed with exit code {proc.returncode}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {mode:9s}: {res['seconds']:6.1f}s, peak RSS {res['peak_rss_mb']:,.0f} MB "
          f"({res['train_rows']:,} train rows -> {res['pool_rows']:,} pool rows, {res['users']:,} users)", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8_000_000, help="rows in tokens.parquet")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=["baseline", "streamed"], help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.group_size, args.seed)))
        return
    with tempfile.TemporaryDirectory(prefix="bench_pool_") as tmp:
        path = Path(tmp) / "tokens.parquet"
        t0 = time.perf_counter()
        users = make_tokens(path, args.n, args.seed)
        print(f"pool benchmark: {args.n:,} rows, {users:,} users, G={args.group_size}, "
              f"file {path.stat().st_size / 2**20:,.0f} MB (written in {time.perf_counter() - t0:.0f}s)", flush=True)
        base = run_child("baseline", path, args.group_size, args.seed)
        streamed = run_child("streamed", path, args.group_size, args.seed)
    same = base["digest"] == streamed["digest"]
    print("\nsummary")
    print(f"  identical pools: {same}")
    print(f"  peak RSS streamed / baseline: {streamed['peak_rss_mb']:,.0f} / {base['peak_rss_mb']:,.0f} MB "
          f"= {streamed['peak_rss_mb'] / base['peak_rss_mb']:.2f}x (kept tokens: {streamed['pool_token_mb']:,.0f} MB)")
    print(f"  time streamed / baseline:     {streamed['seconds']:.1f} / {base['seconds']:.1f}s "
          f"= {streamed['seconds'] / base['seconds']:.2f}x")
    if not same:
        raise SystemExit("the streamed pool differs from the in-memory pool")


if __name__ == "__main__":
    main()
