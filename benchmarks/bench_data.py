"""Benchmark of the data stage: throughput and bounded memory.

Measures, each in a fresh child process (so peak RSS is clean):
- generate:  the synthetic source alone (the baseline the stage cannot beat);
- prepare:   source -> cleaning, user grouping, hash split, statistics,
             examples/users/contributions written (the prepare rule);
- tokenize:  examples.parquet -> tokens.parquet with a BPE trained on the
             public corpus (the tokenize rule).
Prepare runs at N/10 and N examples, tokenize at N/100 and N/10 (the
tokenizer's throughput is the slow part, so it runs at a tenth of the size);
the script prints throughput (examples/s), the ratio of prepare to the
generate baseline, and the peak-RSS ratio between the large and the small
run: close to 1 means memory is bounded by the batch size and the number of
users, not by the number of examples.

    .venv/bin/python benchmarks/bench_data.py            # N = 10 million
    .venv/bin/python benchmarks/bench_data.py --n 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEAN_EXAMPLES_PER_USER = 16.7  # of the default generator (median 8, sigma 1.2, cap 512)


def synth(n_examples: int):
    from userdp.data.synthetic import SyntheticSource

    n_users = max(1, round(n_examples / MEAN_EXAMPLES_PER_USER))
    spec = {"source": "synthetic", "max_examples": n_examples,
            "synthetic": {"n_users": n_users, "public_examples": 20000}}
    return spec, SyntheticSource("bench", spec, "data/bench", 0)


def child(mode: str, n: int, work: Path, batch_rows: int) -> dict:
    start = time.perf_counter()
    if mode == "generate":
        _, src = synth(n)
        rows = sum(b.num_rows for b in src.iter_batches(batch_rows))
        extra = {}
    elif mode == "prepare":
        from userdp.data.prepare import prepare_dataset

        spec, src = synth(n)
        stats = prepare_dataset(src, "bench", spec, work / f"prep_{n}", seed=0, batch_rows=batch_rows)
        rows = sum(stats["n_examples"].values())
        extra = {"users": sum(stats["n_users"].values()), "median_train": stats["median_train"]}
    elif mode == "tokenize":
        import pyarrow.parquet as pq

        from userdp.data.prepare import prepare_dataset, write_public
        from userdp.data.tokenize import tokenize_examples, train_bpe

        spec, src = synth(n)
        out = work / f"tok_{n}"
        prepare_dataset(src, "bench", spec, out, seed=0, batch_rows=batch_rows)
        write_public(src, "bench", out / "public.parquet")
        train_bpe(out / "public.parquet", 2048, out / "tokenizer")
        start = time.perf_counter()  # time tokenization only
        info = tokenize_examples(out / "examples.parquet", out / "tokenizer", out / "tokens.parquet", 48, "truncate",
                                 batch_rows=batch_rows)
        rows = info["examples_out"]
        extra = {"tokens": info["tokens"], "rows_in_file": pq.ParquetFile(out / "tokens.parquet").metadata.num_rows}
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {"mode": mode, "n": n, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "peak_rss_mb": peak_mb, **extra}


def run_child(mode: str, n: int, work: Path, batch_rows: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--n", str(n), "--work", str(work), "--batch-rows", str(batch_rows)]
    env = {**os.environ, "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS", "2")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} at n={n} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {mode:9s} n={n:>11,d}: {res['rows_per_s']:>12,.0f} examples/s  ({res['seconds']:.1f}s)  "
          f"peak RSS {res['peak_rss_mb']:,.0f} MB", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000_000, help="examples in the large prepare run")
    ap.add_argument("--batch-rows", type=int, default=100_000)
    ap.add_argument("--child", choices=["generate", "prepare", "tokenize"], help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--skip-tokenize", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.n, args.work, args.batch_rows)))
        return
    n, small = args.n, max(1, args.n // 10)
    print(f"data-stage benchmark: N={n:,} examples (~{n / MEAN_EXAMPLES_PER_USER:,.0f} users), "
          f"batch_rows={args.batch_rows:,}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        gen = run_child("generate", n, work, args.batch_rows)
        p_small = run_child("prepare", small, work, args.batch_rows)
        p_big = run_child("prepare", n, work, args.batch_rows)
        toks = []
        if not args.skip_tokenize:
            toks = [run_child("tokenize", max(1, n // 100), work, args.batch_rows),
                    run_child("tokenize", small, work, args.batch_rows)]
    print("\nsummary")
    print(f"  prepare throughput at N:            {p_big['rows_per_s']:,.0f} examples/s")
    print(f"  prepare / generate-only throughput: {p_big['rows_per_s'] / gen['rows_per_s']:.2f}x "
          "(baseline: the source alone, same N; prepare includes generating)")
    print(f"  prepare peak RSS N vs N/10:         {p_big['peak_rss_mb']:,.0f} / {p_small['peak_rss_mb']:,.0f} MB "
          f"= {p_big['peak_rss_mb'] / p_small['peak_rss_mb']:.2f}x for 10x the examples "
          f"({p_big['users']:,} vs {p_small['users']:,} users)")
    if toks:
        a, b = toks
        print(f"  tokenize throughput at N/10:        {b['rows_per_s']:,.0f} examples/s "
              f"({b['tokens'] / (b['rows'] / b['rows_per_s']):,.0f} tokens/s)")
        print(f"  tokenize peak RSS N/10 vs N/100:    {b['peak_rss_mb']:,.0f} / {a['peak_rss_mb']:,.0f} MB "
              f"= {b['peak_rss_mb'] / a['peak_rss_mb']:.2f}x for 10x the examples")


if __name__ == "__main__":
    main()
