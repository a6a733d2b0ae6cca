"""Benchmark of the tokenize stage: the previous implementation vs the current one.

Builds (or reuses, with --work) a synthetic examples.parquet of --n examples
and a public corpus of --public texts, trains the byte-level BPE on the
public corpus (timed: the train_tokenizer rule), then tokenizes the examples
in fresh child processes (so peak RSS is clean), alternating, --repeats times:

- old:  a faithful copy of the previous implementation's per-batch loop
        (`encode_batch_fast`, ids to numpy through Python generators,
        in-process Rayon with RAYON_NUM_THREADS = --threads);
- new:  userdp.data.tokenize.tokenize_examples(threads=--threads): with
        --threads > 1 batches are encoded by that many worker processes (one
        Rayon thread each) while the main process frames and writes;
- new1: the current implementation with threads=1: no worker processes,
        in-process Rayon with RAYON_NUM_THREADS = --threads. Its per-batch
        code is the old one, so new1/old shows the noise of the machine.

It prints examples/s, tokens/s, peak RSS (main process and the largest worker
process), the median ratio new/old of the runs, and checks that every run
wrote a byte-identical tokens.parquet. Times are noisy on a shared machine:
compare the ratios of one run, not absolute numbers across runs.

    .venv/bin/python benchmarks/bench_tokenize.py                 # 200k examples, 2 threads
    .venv/bin/python benchmarks/bench_tokenize.py --n 1000000 --threads 4 --mode chunk
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEAN_EXAMPLES_PER_USER = 16.7  # of the default synthetic generator


def build(work: Path, n: int, n_public: int) -> None:
    """examples.parquet (n examples) and public.parquet (n_public texts) in `work`, unless present."""
    if (work / "examples.parquet").exists() and (work / "public.parquet").exists():
        return
    from userdp.data.prepare import prepare_dataset, write_public
    from userdp.data.synthetic import SyntheticSource

    spec = {"source": "synthetic", "max_examples": n,
            "synthetic": {"n_users": max(1, round(n / MEAN_EXAMPLES_PER_USER)), "public_examples": n_public}}
    src = SyntheticSource("bench", spec, "data/bench", 0)
    prepare_dataset(src, "bench", spec, work, seed=0, batch_rows=100_000)
    write_public(src, "bench", work / "public.parquet")


# ----------------------------------------------------------------- baseline
# A faithful copy of the previous implementation's per-batch tokenization
# (workflow/userdp/data/tokenize.py before this benchmark was written).


def old_encode(tok, texts):
    import numpy as np

    backend = tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok
    encs = backend.encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def old_tokenize_examples(examples_path, tok_dir, out_path, seq_len, mode="truncate", batch_rows=10_000) -> dict:
    import numpy as np
    import pyarrow as pa

    from userdp.data.tokenize import TOKENS_SCHEMA, _list_array, _schema_with_meta, _special, frame, load_tokenizer
    from userdp.io import ParquetBatchWriter, streaming_parquet

    tok = load_tokenizer(tok_dir)
    bos, eos = _special(tok)
    schema = _schema_with_meta(TOKENS_SCHEMA, tok, seq_len, mode)
    n_in = n_out = n_trunc = n_tok = 0
    next_id = 0
    pf = streaming_parquet(examples_path)
    with ParquetBatchWriter(out_path, schema) as writer:
        for batch in pf.iter_batches(batch_size=batch_rows):
            flat, lengths = old_encode(tok, batch.column("text").to_pylist())
            ids, out_len, row = frame(flat, lengths, bos, eos, seq_len, mode)
            src_ids = batch.column("example_id").to_numpy()[row]
            if mode == "chunk":
                ex_ids = np.arange(next_id, next_id + len(row), dtype=np.int64)
                next_id += len(row)
            else:
                ex_ids = src_ids
            take = pa.array(row)
            writer.write(pa.table({
                "user_id": batch.column("user_id").take(take),
                "example_id": pa.array(ex_ids, pa.int64()),
                "split": batch.column("split").take(take),
                "input_ids": _list_array(ids, out_len),
                "n_tokens": pa.array(out_len.astype(np.int32)),
                "source_example_id": pa.array(src_ids, pa.int64()),
            }, schema=schema))
            n_in += batch.num_rows
            n_out += len(row)
            n_trunc += int((lengths + 2 > seq_len).sum())
            n_tok += int(out_len.sum())
    return {"examples_in": n_in, "examples_out": n_out, "longer_than_sequence_length": n_trunc, "tokens": n_tok,
            "sequence_length": seq_len, "long_examples": mode}


# ----------------------------------------------------------------- children


def child(args) -> dict:
    work = args.work
    out = work / f"tokens_{args.child}_{args.rep}.parquet"
    # Imports before the clock (as a long run amortises them); worker start-up stays inside.
    import transformers  # noqa: F401

    import userdp.data.tokenize  # noqa: F401

    start = time.perf_counter()
    cpu0, thread0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
    if args.child == "build":
        build(work, args.n, args.public)
        res = {}
    elif args.child == "train":
        from userdp.data.tokenize import train_bpe

        info = train_bpe(work / "public.parquet", args.vocab_size, work / "tokenizer")
        res = {"texts": info["n_texts"], "vocab_size": info["vocab_size"]}
    else:
        if args.child == "old":
            info = old_tokenize_examples(work / "examples.parquet", work / "tokenizer", out, args.seq_len, args.mode,
                                         batch_rows=args.batch_rows)
        else:
            from userdp.data.tokenize import tokenize_examples

            threads = 1 if args.child == "new1" else args.threads
            info = tokenize_examples(work / "examples.parquet", work / "tokenizer", out, args.seq_len, args.mode,
                                     batch_rows=args.batch_rows, threads=threads)
        res = {"examples": info["examples_in"], "tokens": info["tokens"],
               "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
        out.unlink()
    seconds = time.perf_counter() - start
    me_now = resource.getrusage(resource.RUSAGE_SELF)
    main_cpu = me_now.ru_utime + me_now.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker processes, once joined
    cpu = main_cpu + kids.ru_utime + kids.ru_stime
    # Serial part, in CPU seconds (the work more cores cannot spread): without worker processes,
    # the main thread's CPU time (all but the Rayon threads' share of encoding); with them, the
    # main process's CPU time (reading, pickling, framing, writing).
    res["serial_s"] = main_cpu if args.child == "new" and args.threads > 1 else time.thread_time() - thread0
    return {"seconds": seconds, "cpu_s": cpu, **res,
            "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
            "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def run_child(args, kind: str, rep: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--rep", str(rep), "--work", str(args.work),
           "--n", str(args.n), "--batch-rows", str(args.batch_rows), "--threads", str(args.threads),
           "--seq-len", str(args.seq_len), "--mode", args.mode, "--vocab-size", str(args.vocab_size),
           "--public", str(args.public)]
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000, help="examples (default 200k)")
    ap.add_argument("--public", type=int, default=20_000, help="public texts the BPE trains on (default 20k)")
    ap.add_argument("--threads", type=int, default=2, help="the rule's threads (default 2)")
    ap.add_argument("--batch-rows", type=int, default=10_000, help="tokenizer.batch_rows (default 10000)")
    ap.add_argument("--seq-len", type=int, default=48)
    ap.add_argument("--mode", choices=["truncate", "chunk"], default="truncate")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="alternating old/new runs (default 3)")
    ap.add_argument("--work", type=Path, help="folder to build in / reuse (default: a temporary folder)")
    ap.add_argument("--child", choices=["build", "train", "old", "new", "new1"], help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp:
        args.work = args.work or Path(tmp)
        args.work.mkdir(parents=True, exist_ok=True)
        # In a child too: Linux carries the parent's peak RSS into the children's ru_maxrss.
        b = run_child(args, "build")
        print(f"tokenize benchmark: {args.n:,} examples, {args.threads} threads, batch_rows={args.batch_rows:,}, "
              f"{args.mode} to {args.seq_len}, {os.cpu_count()} CPUs (data built/reused in {b['seconds']:.1f}s)")
        tr = run_child(args, "train")
        print(f"  train BPE on {tr['texts']:,} public texts (vocab {tr['vocab_size']:,}): {tr['seconds']:.2f}s "
              f"({tr['texts'] / tr['seconds']:,.0f} texts/s), peak RSS {tr['rss_main_mb']:,.0f} MB", flush=True)
        runs: dict[str, list[dict]] = {"old": [], "new": [], "new1": []}
        for rep in range(args.repeats):
            for kind in runs:
                r = run_child(args, kind, rep)
                runs[kind].append(r)
                print(f"  {kind:4s} #{rep}: {r['examples'] / r['seconds']:>9,.0f} examples/s "
                      f"{r['tokens'] / r['seconds']:>11,.0f} tokens/s ({r['seconds']:.2f}s wall, {r['cpu_s']:.2f}s CPU)  peak RSS main "
                      f"{r['rss_main_mb']:,.0f} MB, largest worker {r['rss_worker_mb']:,.0f} MB", flush=True)
    hashes = {r["sha256"] for rs in runs.values() for r in rs}
    print("\nsummary (medians over repeats)")
    med = {k: statistics.median(r["seconds"] for r in rs) for k, rs in runs.items()}
    ex, toks = runs["old"][0]["examples"], runs["old"][0]["tokens"]
    for k in runs:
        print(f"  {k:4s}: {ex / med[k]:>9,.0f} examples/s {toks / med[k]:>11,.0f} tokens/s")
    print(f"  ratio new/old throughput  (threads={args.threads}): {med['old'] / med['new']:.2f}x")
    print(f"  ratio new1/old throughput (no workers, Rayon only):{med['old'] / med['new1']:.2f}x")
    per_rep = [o["seconds"] / n["seconds"] for o, n in zip(runs["old"], runs["new"])]
    cpu = {k: statistics.median(r["cpu_s"] for r in rs) for k, rs in runs.items()}
    print(f"  CPU seconds (process + workers): old {cpu['old']:.2f}, new {cpu['new']:.2f}, "
          f"new1 {cpu['new1']:.2f}")
    ser = {k: statistics.median(r["serial_s"] for r in rs) for k, rs in runs.items()}
    print("  serial CPU seconds (Amdahl bound on throughput with any number of cores): "
          + ", ".join(f"{k} {ser[k]:.2f}s (<= {ex / ser[k]:,.0f} examples/s)" for k in runs))
    print(f"  ratio of bounds new/old: {ser['old'] / ser['new']:.1f}x")
    print(f"  per-repeat new/old ratios: {', '.join(f'{x:.2f}' for x in per_rep)}")
    print(f"  outputs byte-identical across old/new/new1 and repeats: {len(hashes) == 1}")
    if len(hashes) != 1:
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
