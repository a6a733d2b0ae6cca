"""Behaviour check for refactors: compare two results/ trees of the same config, file by file.

Plans, ledgers, metrics, evaluations, data statistics, findings (JSON: every field), summaries, train logs,
data and mean-estimation tables (Parquet: exact), and model weights (SHA-256). Machine-dependent values are left
out: the calibration's wall time and per-step seconds, and the logs and per-job benchmark files (which jobs
ran differs when a second run reuses downloaded data). Prints what it compared and every difference; exits 1
when there is a difference, 2 when a tree is missing.

    python benchmarks/compare_results.py RESULTS_A RESULTS_B

Used for the typed run spec (issue 23) and the pipeline speed-ups (issue 26): the default config run from an
empty results/ before and after the change, compared with no difference.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path, PurePosixPath

import pandas as pd

from userdp import layout

# The wall times, and the digest of the userdp code that ran (it changes with every commit).
SKIP_KEYS = {"seconds", "wall_seconds", "userdp_code"}
# Folders of a results/ tree whose files record how a run went, not what it produced.
TIMING_DIRS = {PurePosixPath(layout.LOGS).name, PurePosixPath(layout.BENCHMARKS).name, "cache"}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in SKIP_KEYS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def diff(a, b, path: str = "") -> list[str]:
    """Every difference between two JSON values, each as 'path: what differs'."""
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


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")
            if p.is_file() and ".snakemake" not in p.parts and not TIMING_DIRS & set(p.relative_to(root).parts)}


def _compare_file(pa: Path, pb: Path, rel: Path) -> tuple[str | None, list[str]]:
    parts = rel.parts
    if rel.suffix == ".json" and ("plan" in parts or rel.name in ("ledger.json", "metrics.json", "eval.json")
                                  or "findings" in parts or "summary" in parts or "data" in parts):
        return "json", diff(_strip(json.loads(pa.read_text())), _strip(json.loads(pb.read_text())))
    if rel.suffix == ".safetensors":
        return "weights", [] if _sha(pa) == _sha(pb) else ["SHA-256 differs"]
    if rel.suffix == ".parquet" and ("summary" in parts or rel.name == "train_log.parquet" or "data" in parts
                                     or "mean_estimation" in parts or "accounting" in parts):
        fa, fb = pd.read_parquet(pa), pd.read_parquet(pb)
        drop = [c for c in set(fa.columns) | set(fb.columns)
                if "seconds" in c or c.endswith("_s") or c.split(".")[-1] in SKIP_KEYS]
        fa, fb = fa.drop(columns=drop, errors="ignore"), fb.drop(columns=drop, errors="ignore")
        try:
            pd.testing.assert_frame_equal(fa, fb, check_exact=True)
        except AssertionError as exc:
            return "parquet", [str(exc).splitlines()[0] + " | " + " ".join(str(exc).split())[:300]]
        return "parquet", []
    return None, []


def compare(a: Path, b: Path) -> tuple[dict[str, int], list[str]]:
    """(files compared per kind, every difference) between the results/ trees `a` and `b`."""
    files_a, files_b = _files(a), _files(b)
    counts: dict[str, int] = {}
    problems = [f"{rel}: only in {'A' if rel in files_a else 'B'}" for rel in sorted(files_a ^ files_b)]
    for rel in sorted(files_a & files_b):
        kind, found = _compare_file(a / rel, b / rel, rel)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
            problems += [f"{rel}: {x}" for x in found]
    return counts, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_a", type=Path, help="the first results/ tree (A)")
    parser.add_argument("results_b", type=Path, help="the second results/ tree (B)")
    args = parser.parse_args(argv)
    for label, root in (("A", args.results_a), ("B", args.results_b)):
        if not root.is_dir():
            print(f"compare_results: {label} = {root} is not a folder; give two results/ trees "
                  "(for example a copy of results/ from before a change, and results/)", file=sys.stderr)
            return 2
    counts, problems = compare(args.results_a, args.results_b)
    print("compared:", dict(sorted(counts.items())))
    print(f"{len(problems)} differences")
    for p in problems:
        print(" ", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
