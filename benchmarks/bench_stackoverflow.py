"""Benchmark of the Stack Overflow data path at paper scale: throughput and bounded memory.

The full TFF Stack Overflow release has about 135 million train rows (169
million with heldout and test). This script builds a synthetic SQLite file
in the exact TFF schema and format, then measures the project's real code
path on it:

- build:    the synthetic file (cached under --workdir by N and seed; timed
            separately, never part of the measurements);
- load:     `StackOverflowSource.iter_batches` alone (SQLite keyset pages +
            tf.train.Example decoding): the baseline the stage cannot beat;
- prepare:  the same source feeding `prepare_dataset` (what the prepare_data
            rule runs), writing examples.parquet, users.parquet and
            contributions.json into the workdir.

Each measurement runs in a fresh child process, so every peak RSS
(VmHWM) is its own. A thread in the child also samples RSS (psutil)
to compare the peak over 10-50% and over 50-90% of the run's time: a stream
whose memory does not grow with rows has the same peak in both.
Prepare runs on the first N/10 rows (`max_examples`) and on all N rows; the
summary prints the peak-RSS ratio N vs N/10 (close to 1 = memory bounded by
the batch size and the number of users, not the number of rows) and the
users and rows of both runs.

The synthetic file: `examples(split_name, client_id, serialized_example_proto)`
with the release's two indexes and `client_metadata(client_id, split_name,
num_examples)`. Client ids are zero-padded numeric strings; rows per client
are heavy-tailed (log-normal, median 80, capped); clients whose numeric id is
divisible by 10 are `heldout` (all their rows), the others' rows are divided
between `train` and `test` (about 11% test, the later rows, as the release
splits by date). Rows are stored client by client. Each blob is a real
serialized tf.train.Example with tokens/title/tags/type/score/creation_date:
a few thousand distinct examples are serialized once, each with a
fixed-width number inside its tokens that is rewritten per row (cheap
bytes surgery that keeps the wire format valid), so no two rows' texts are
equal.

    .venv/bin/python benchmarks/bench_stackoverflow.py                 # N = 50 million
    .venv/bin/python benchmarks/bench_stackoverflow.py --n 2000000     # a quick look
    .venv/bin/python benchmarks/bench_stackoverflow.py --n 20000000 --delete-db
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

DIGITS = 9  # width of the per-row number inside the tokens (rows up to 10**9)
PLACEHOLDER = b"#" * DIGITS
N_TEMPLATES = 4096
TEST_SHARE = 0.11  # release: ~16.6M test rows next to ~135.8M train rows
BYTES_PER_ROW = 420  # table + both indexes, measured on this generator (~360) plus margin
CHUNK_ROWS = 1_000_000
_HELD: list = []  # open lock files

WORDS = (
    "i you the a an to of in is it that for with on this can use my how do what when but not be if have "
    "are file function error code value list string array class method object data python java c# javascript "
    "sql query table server client request response null return type int var new loop index key map set get "
    "from import package module library version install run build test debug exception stack trace thread "
    "memory pointer reference variable parameter argument call example question answer problem solution "
    "work works working try tried using used want need should would could also just like any some all "
    "one two first last . , ? ( ) = ; : ' \" <URL> { } [ ]"
).split()
TAGS = ("python", "java", "c#", "javascript", "sql", "android", "php", "c++", "jquery", "html", "css", "ios",
        "linux", "git", "regex", "numpy", "pandas", "django", "node.js", "r")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the synthetic file


def _templates(rng: np.random.Generator) -> list[tuple[bytes, bytes]]:
    """(prefix, suffix) of distinct serialized Examples around the per-row number placeholder."""
    from userdp.data.tfexample import make_example

    out = []
    for k in range(N_TEMPLATES):
        n_tok = int(np.clip(rng.lognormal(np.log(16), 0.6), 3, 120))
        words = list(rng.choice(WORDS, size=n_tok))
        words.insert(int(rng.integers(0, n_tok + 1)), PLACEHOLDER.decode())
        title = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 14))))
        tags = "|".join(sorted(set(rng.choice(TAGS, size=int(rng.integers(1, 5))))))
        tokens = " ".join(words).encode()
        blob = make_example({
            "tokens": tokens,
            "title": title + " ?",
            "tags": tags,
            "type": "question" if k % 3 == 0 else "answer",
            "score": int(rng.integers(-3, 500)),
            "creation_date": f"20{8 + k % 10:02d}-{1 + k % 12:02d}-{1 + k % 28:02d} "
                             f"{k % 24:02d}:{k % 60:02d}:{(7 * k) % 60:02d}.{k % 1000:03d} UTC",
        })
        # the placeholder inside the tokens bytes (a length byte 0x23 = '#' may precede them)
        i = blob.index(tokens) + tokens.index(PLACEHOLDER)
        out.append((blob[:i], blob[i + DIGITS:]))
    return out


def _clients(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(numeric ids, rows per client) summing to exactly n; heavy-tailed counts."""
    ids, counts, total, last = [], [], 0, 0
    while total < n:
        c = np.minimum(np.maximum(rng.lognormal(np.log(80), 1.6, 100_000).astype(np.int64), 1), 200_000)
        gaps = rng.integers(1, 4, c.size)  # sparse ids, as real account ids; ~10% divisible by 10
        ids.append(last + np.cumsum(gaps))
        last = int(ids[-1][-1])
        counts.append(c)
        total += int(c.sum())
    ids, counts = np.concatenate(ids), np.concatenate(counts)
    cum = np.cumsum(counts)
    k = int(np.searchsorted(cum, n)) + 1  # clients needed to reach n rows
    ids, counts = ids[:k], counts[:k].copy()
    counts[-1] -= int(cum[k - 1] - n)
    return ids, counts


def build_sqlite(path: Path, n: int, seed: int) -> dict:
    """Write an n-row TFF-format Stack Overflow SQLite at `path` (via a temporary name)."""
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".building")
    tmp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    templates = _templates(rng)
    ids, counts = _clients(n, rng)
    heldout = ids % 10 == 0
    n_test = np.where(heldout, 0, rng.binomial(counts, TEST_SHARE))
    log(f"build: {n:,} rows, {ids.size:,} clients ({int(heldout.sum()):,} heldout), "
        f"{len(templates):,} templates -> {tmp}")
    con = sqlite3.connect(tmp)
    for pragma in ("journal_mode=OFF", "synchronous=OFF", "locking_mode=EXCLUSIVE", "cache_size=-262144"):
        con.execute(f"PRAGMA {pragma}")
    con.executescript(
        """
        CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,
                               serialized_example_proto BLOB NOT NULL);
        CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL,
                                      num_examples INTEGER NOT NULL);
        """
    )
    tpl = rng.integers(0, len(templates), size=min(n, 1 << 22))  # template of row r: tpl[r % len(tpl)]
    meta: list[tuple[str, str, int]] = []
    splits: list[str] = []
    clients: list[str] = []
    row = 0
    done_at = time.perf_counter()

    def flush() -> None:
        nonlocal row, splits, clients, done_at
        k = len(splits)
        pick = tpl[np.arange(row, row + k) % tpl.size].tolist()
        blobs = [templates[t][0] + b"%09d" % (r % 10**DIGITS) + templates[t][1]
                 for t, r in zip(pick, range(row, row + k))]
        con.execute("BEGIN")
        con.executemany("INSERT INTO examples VALUES (?, ?, ?)", zip(splits, clients, blobs))
        con.execute("COMMIT")
        row += k
        splits, clients = [], []
        now = time.perf_counter()
        if now - done_at > 15 or row == n:
            done_at = now
            rate = row / (now - t0)
            log(f"build: {row:,}/{n:,} rows ({100 * row / n:.0f}%), {rate:,.0f} rows/s, "
                f"ETA {(n - row) / rate:.0f}s (+ indexes)")

    for cid_num, c, t, h in zip(ids.tolist(), counts.tolist(), n_test.tolist(), heldout.tolist()):
        cid = f"{cid_num:08d}"
        if h:
            parts = (("heldout", c),)
        else:  # train before test (the release splits a client's rows by date)
            parts = (("train", c - t), ("test", t))
        for split, k in parts:
            if k:
                splits += [split] * k
                clients += [cid] * k
                meta.append((cid, split, k))
        if len(splits) >= CHUNK_ROWS:
            flush()
    if splits:
        flush()
    t_rows = time.perf_counter() - t0
    log("build: creating the two indexes of the release (client_id; split_name, client_id)")
    con.executescript(
        """
        CREATE INDEX example_client_id ON examples (client_id);
        CREATE INDEX example_split_client_ids ON examples (split_name, client_id);
        """
    )
    con.executemany("INSERT INTO client_metadata VALUES (?, ?, ?)", meta)
    con.execute("CREATE INDEX client_metadata_split_name ON client_metadata (split_name)")
    con.commit()
    con.close()
    os.replace(tmp, path)
    seconds = time.perf_counter() - t0
    by_split = {s: int(sum(k for _, sp, k in meta if sp == s)) for s in ("train", "heldout", "test")}
    info = {"n": n, "seed": seed, "clients": int(ids.size), "heldout_clients": int(heldout.sum()),
            "rows_by_split": by_split, "max_rows_per_client": int(counts.max()),
            "median_rows_per_client": float(np.median(counts)), "bytes": path.stat().st_size,
            "build_s": seconds, "rows_s": t_rows, "index_s": seconds - t_rows}
    log(f"build: done in {seconds:.0f}s (rows {t_rows:.0f}s, indexes+metadata {seconds - t_rows:.0f}s), "
        f"{info['bytes'] / 2**30:.1f} GiB")
    return info


def ensure_sqlite(workdir: Path, n: int, seed: int) -> tuple[Path, dict, bool]:
    """The cached file for (n, seed), built if missing; (path, build info, reused?)."""
    path = workdir / f"so_n{n}_s{seed}.sqlite"
    info_path = path.with_suffix(".json")
    workdir.mkdir(parents=True, exist_ok=True)
    lock = open(workdir / ".lock", "w")
    _HELD.append(lock)  # keep it open (and locked) until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"another bench_stackoverflow.py is using {workdir}; wait for it or use another --workdir.")
    if path.exists() and info_path.exists():
        return path, json.loads(info_path.read_text()), True
    free = shutil.disk_usage(workdir).free
    need = int(n * BYTES_PER_ROW * 1.15)  # + prepare outputs (examples.parquet) and SQLite sort temp files
    if free < need:
        raise SystemExit(
            f"not enough disk space in {workdir}: {free / 2**30:.1f} GiB free, about {need / 2**30:.1f} GiB "
            f"needed for {n:,} rows (file, indexes, prepare outputs). Use a smaller --n or another --workdir."
        )
    info = build_sqlite(path, n, seed)
    info_path.write_text(json.dumps(info, indent=2))
    return path, info, False


# ---------------------------------------------------------------- measurements (child processes)


class RssSampler(threading.Thread):
    """Samples this process's RSS every `every_s` seconds (psutil) into a timeline."""

    def __init__(self, every_s: float = 0.5):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.every_s = psutil.Process(), every_s
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.proc.memory_info().rss))
            self.stop.wait(self.every_s)

    def halves_mb(self) -> tuple[float, float]:
        """Peak RSS (MB) over 10-50% and over 50-90% of the run's time.

        The first and last tenth are left out: start-up, and the final
        per-user step of prepare (users table, statistics), which is bounded
        by the users and always falls at the end.
        """
        if not self.samples:
            return 0.0, 0.0
        end = self.samples[-1][0]
        first = [r for t, r in self.samples if 0.1 * end < t <= 0.5 * end] or [0]
        second = [r for t, r in self.samples if 0.5 * end < t <= 0.9 * end] or [0]
        return max(first) / 2**20, max(second) / 2**20


def peak_rss_mb() -> float:
    """This process's peak RSS in MB.

    VmHWM (Linux) belongs to the address space, which exec replaces; ru_maxrss
    would not do here, as Linux carries it over exec from the parent (the
    builder, whose peak is unrelated).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, db: Path, rows: int | None, work: Path, batch_rows: int, seed: int) -> dict:
    import logging

    import pyarrow as pa

    from userdp.data.stackoverflow import StackOverflowSource
    from userdp.logutil import setup_logging

    setup_logging(None)  # progress lines of the source and the stage go to stderr
    logging.getLogger("userdp").info("%s: child pid %d", mode, os.getpid())
    pa.set_cpu_count(1)  # as the prepare_data rule (threads: 1)
    spec = {"source": "stackoverflow", "path": str(db)}
    if rows is not None:
        spec["max_examples"] = rows
    src = StackOverflowSource("so", spec, work / "data", seed)
    sampler = RssSampler()
    sampler.start()
    start = time.perf_counter()
    if mode == "load":
        n_rows = sum(b.num_rows for b in src.iter_batches(batch_rows))
        extra: dict = {}
    elif mode == "prepare":
        from userdp.data.prepare import prepare_dataset

        out = work / f"prepare_{rows or 'all'}"
        stats = prepare_dataset(src, "so", spec, out, seed=seed, batch_rows=batch_rows)
        n_rows = stats["n_raw_examples"]
        extra = {"users": sum(stats["n_users"].values()), "n_users": stats["n_users"],
                 "n_examples": stats["n_examples"], "max_train": stats["max_train"],
                 "median_train": stats["median_train"],
                 "examples_parquet_mb": (out / "examples.parquet").stat().st_size / 2**20}
        shutil.rmtree(out)  # outputs can be several GB at N
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    first, second = sampler.halves_mb()
    return {"mode": mode, "rows": n_rows, "seconds": seconds, "rows_per_s": n_rows / seconds,
            "peak_rss_mb": peak_rss_mb(), "peak_first_half_mb": first, "peak_second_half_mb": second, **extra}


def run_child(mode: str, db: Path, rows: int | None, work: Path, batch_rows: int, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--db", str(db), "--work", str(work),
           "--batch-rows", str(batch_rows), "--seed", str(seed)]
    if rows is not None:
        cmd += ["--rows", str(rows)]
    log(f"{mode} on {'all' if rows is None else f'the first {rows:,}'} rows (fresh process)")
    # stderr (progress lines) streams through; the result is the last stdout line
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} (rows={rows}) failed with exit code {proc.returncode}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    users = f", {res['users']:,} users" if "users" in res else ""
    log(f"{mode:8s} {res['rows']:>12,d} rows{users}: {res['rows_per_s']:>10,.0f} rows/s ({res['seconds']:.0f}s), "
        f"peak RSS {res['peak_rss_mb']:,.0f} MB (10-50% / 50-90% of the run {res['peak_first_half_mb']:,.0f}/"
        f"{res['peak_second_half_mb']:,.0f} MB)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50_000_000, help="rows in the synthetic file (all splits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/userdp-bench-so"))
    ap.add_argument("--batch-rows", type=int, default=10_000, help="as tokenizer.batch_rows (default 10000)")
    ap.add_argument("--skip-load-at-n", action="store_true",
                    help="time the loader alone on N/10 rows only (saves its N-row pass)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--delete-db", action="store_true", help="delete the synthetic file at the end")
    ap.add_argument("--child", choices=["load", "prepare"], help=argparse.SUPPRESS)
    ap.add_argument("--db", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.db, args.rows, args.work, args.batch_rows, args.seed)))
        return

    n = args.n
    print(f"Stack Overflow data benchmark: N={n:,} rows, seed {args.seed}, batch_rows={args.batch_rows:,}, "
          f"{os.cpu_count()} CPUs, workdir {args.workdir}", flush=True)
    db, info, reused = ensure_sqlite(args.workdir, n, args.seed)  # holds a lock on the workdir until exit
    print(f"file: {db} ({info['bytes'] / 2**30:.1f} GiB), {info['clients']:,} clients, rows by split "
          f"{info['rows_by_split']}, rows per client median {info['median_rows_per_client']:g} max "
          f"{info['max_rows_per_client']:,}; "
          + (f"reused (built earlier in {info['build_s']:.0f}s)" if reused else
             f"built in {info['build_s']:.0f}s (rows {info['rows_s']:.0f}s, indexes {info['index_s']:.0f}s)"),
          flush=True)
    if args.build_only:
        return
    small = max(1, n // 10)
    work = args.workdir / "work"
    try:
        load = run_child("load", db, small, work, args.batch_rows, args.seed)
        load_n = run_child("load", db, None, work, args.batch_rows, args.seed) if not args.skip_load_at_n else None
        p_small = run_child("prepare", db, small, work, args.batch_rows, args.seed)
        p_big = run_child("prepare", db, None, work, args.batch_rows, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.delete_db:
            db.unlink(missing_ok=True)
            db.with_suffix(".json").unlink(missing_ok=True)

    print("\nsummary")
    print(f"  build ({n:,} rows, {info['clients']:,} clients): {info['build_s']:.0f}s "
          f"= {n / info['rows_s']:,.0f} rows/s inserting + {info['index_s']:.0f}s indexes"
          + (" (reused this run)" if reused else ""))
    print(f"  loader alone (SQLite pages + Example decoding): {load['rows_per_s']:,.0f} rows/s on "
          f"{load['rows']:,} rows, peak RSS {load['peak_rss_mb']:,.0f} MB")
    if load_n:
        print(f"  loader alone on all rows:                     {load_n['rows_per_s']:,.0f} rows/s on "
              f"{load_n['rows']:,} rows, peak RSS {load_n['peak_rss_mb']:,.0f} MB")
    base = load_n or load
    print(f"  prepare at N:    {p_big['rows_per_s']:,.0f} rows/s ({p_big['rows']:,} rows read, "
          f"{p_big['users']:,} users, {p_big['seconds']:.0f}s); {p_big['rows_per_s'] / base['rows_per_s']:.2f}x "
          f"the loader-alone throughput (baseline: the loader on {base['rows']:,} rows, same run)")
    print(f"  prepare at N/10: {p_small['rows_per_s']:,.0f} rows/s ({p_small['rows']:,} rows read, "
          f"{p_small['users']:,} users, {p_small['seconds']:.0f}s)")
    print(f"  prepare peak RSS N vs N/10: {p_big['peak_rss_mb']:,.0f} / {p_small['peak_rss_mb']:,.0f} MB "
          f"= {p_big['peak_rss_mb'] / p_small['peak_rss_mb']:.2f}x for {p_big['rows'] / p_small['rows']:.1f}x "
          f"the rows and {p_big['users'] / p_small['users']:.1f}x the users")
    print(f"  prepare peak RSS within the N run, 10-50% vs 50-90% of its time: {p_big['peak_first_half_mb']:,.0f} / "
          f"{p_big['peak_second_half_mb']:,.0f} MB = "
          f"{p_big['peak_second_half_mb'] / max(p_big['peak_first_half_mb'], 1e-9):.2f}x")
    full = 135_818_730 + 16_491_230  # release train + heldout rows (the default splits)
    print(f"  extrapolated prepare time for the full release ({full:,} train + heldout rows): "
          f"{full / p_big['rows_per_s'] / 60:.0f} min at this rate")


if __name__ == "__main__":
    main()
