"""Behaviour check for refactors: compare two results/ trees of the same config, file by file.

Plans, ledgers, metrics, evaluations, data statistics, findings (JSON: every field), summaries, train logs,
data and mean-estimation tables (Parquet: exact), and model weights (SHA-256). Machine-dependent values are left
out: the calibration's wall time and per-step seconds. Prints what it compared and every difference.

    python benchmarks/compare_results.py RESULTS_A RESULTS_B

Used for the typed run spec (issue 23): the default config and tests/configs/tiny.yaml, run from an empty
results/ before and after the change, compared with no difference.
"""
import hashlib
import json
import sys
from pathlib import Path

import pandas as pd

A, B = Path(sys.argv[1]), Path(sys.argv[2])
SKIP_KEYS = {"seconds", "wall_seconds"}


def load(p):
    return json.loads(p.read_text())


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in SKIP_KEYS}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def diff(a, b, path=""):
    out = []
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'B' if k not in a else 'A'}")
            else:
                out += diff(a[k], b[k], f"{path}.{k}")
    elif a != b:
        out.append(f"{path}: {str(a)[:80]} != {str(b)[:80]}")
    return out


def sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


counts, problems = {}, []
files_a = {p.relative_to(A) for p in A.rglob("*") if p.is_file() and ".snakemake" not in p.parts}
files_b = {p.relative_to(B) for p in B.rglob("*") if p.is_file() and ".snakemake" not in p.parts}
for rel in sorted(files_a ^ files_b):
    if rel.suffix not in (".log",) and "logs" not in rel.parts and "cache" not in rel.parts:
        problems.append(f"{rel}: only in {'A' if rel in files_a else 'B'}")
for rel in sorted(files_a & files_b):
    pa_, pb = A / rel, B / rel
    parts = rel.parts
    kind = None
    if rel.suffix == ".json" and ("plan" in parts or rel.name in ("ledger.json", "metrics.json", "eval.json")
                                  or "findings" in parts or "summary" in parts or "data" in parts):
        kind = "json"
        d = diff(strip(load(pa_)), strip(load(pb)))
    elif rel.suffix == ".safetensors":
        kind = "weights"
        d = [] if sha(pa_) == sha(pb) else ["SHA-256 differs"]
    elif rel.suffix == ".parquet" and ("summary" in parts or rel.name in ("train_log.parquet",) or "data" in parts
                                       or "mean_estimation" in parts or "accounting" in parts):
        kind = "parquet"
        fa, fb = pd.read_parquet(pa_), pd.read_parquet(pb)
        drop = [c for c in fa.columns if "seconds" in c or c.endswith("_s")]
        fa, fb = fa.drop(columns=drop, errors="ignore"), fb.drop(columns=drop, errors="ignore")
        try:
            pd.testing.assert_frame_equal(fa, fb, check_exact=True)
            d = []
        except AssertionError as exc:
            d = [str(exc).splitlines()[0] + " | " + " ".join(str(exc).split())[:300]]
    if kind:
        counts[kind] = counts.get(kind, 0) + 1
        problems += [f"{rel}: {x}" for x in d]
print("compared:", counts)
print(f"{len(problems)} differences")
for p in problems:
    print(" ", p)
