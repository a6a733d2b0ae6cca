"""Where a pipeline run spends its time, per rule, from snakemake's own records.

Reads a run's snakemake log (`.snakemake/log/<time>.snakemake.log`, the newest by default) for each job's
rule, its start and finish and its benchmark file (`benchmark:` of every rule, under results/benchmarks/:
userdp.layout.benchmark_of), and prints per rule: jobs, wall seconds (sum and mean, from the benchmark
files), CPU seconds, and the run's "Elapsed time". With --baseline, a second run's log (for example the
same command on the commit before a change) is read the same way and each rule's wall and CPU time is
printed as a ratio after/before, so both runs must have been measured on the same machine, ideally
quiet (`uptime` before and after).

    .venv/bin/snakemake --cores 2                     # an empty results/
    .venv/bin/python benchmarks/profile_pipeline.py   # this run, per rule
    .venv/bin/python benchmarks/profile_pipeline.py --log AFTER.log --baseline BEFORE.log --root-baseline DIR

Benchmark paths in a log are relative to the run's working directory: --root (and --root-baseline) name
it when the log is not under <root>/.snakemake/log/. Jobs whose benchmark file is missing (a run that
was cut short) count with the wall time between their start and finish lines in the log (1 s resolution),
and so do jobs whose benchmark file was written outside their start and finish (a later run of the same
job rewrote it: a warning says so); profile a run right after it ends.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]$")
_RULE = re.compile(r"^(?:local)?rule (\w+):$")
_FIELD = re.compile(r"^\s+(jobid|benchmark): (.+)$")
_FINISHED = re.compile(r"^Finished jobid: (\d+)")
_ELAPSED = re.compile(r"^Elapsed time: (\d+):(\d+):([\d.]+)")


@dataclass
class Job:
    rule: str
    started: dt.datetime | None
    finished: dt.datetime | None = None
    benchmark: str | None = None
    wall_s: float | None = None
    cpu_s: float | None = None


@dataclass
class Run:
    log: Path
    jobs: list[Job]
    elapsed_s: float | None


def read_run(log: Path, root: Path) -> Run:
    """The jobs of one snakemake log, with their benchmark files' wall and CPU seconds where present."""
    stamp = None
    pending: Job | None = None
    by_id: dict[str, Job] = {}
    elapsed = None
    for line in log.read_text().splitlines():
        if m := _STAMP.match(line):
            stamp = dt.datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := _RULE.match(line):
            pending = Job(rule=m.group(1), started=stamp)
        elif (m := _FIELD.match(line)) and pending is not None:
            if m.group(1) == "jobid":
                by_id[m.group(2).strip()] = pending
            else:
                pending.benchmark = m.group(2).strip()
        elif m := _FINISHED.match(line):
            if m.group(1) in by_id:
                by_id[m.group(1)].finished = stamp
        elif m := _ELAPSED.match(line):
            elapsed = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    jobs = [j for j in by_id.values() if j.finished is not None and j.rule != "all"]
    stale = []
    for job in jobs:
        path = root / job.benchmark if job.benchmark else None
        if path is not None and path.exists() and not _written_by(job, path):
            stale.append(str(path))
            path = None
        if path is not None and path.exists():
            with path.open() as f:
                row = next(csv.DictReader(f, delimiter="\t"))
            job.wall_s = float(row["s"])
            cpu = row.get("cpu_time", "NA")
            job.cpu_s = float(cpu) if cpu not in ("", "NA", "-") else None
        elif job.started is not None:
            job.wall_s = (job.finished - job.started).total_seconds()
    if stale:
        print(f"profile_pipeline: warning: {len(stale)} benchmark file(s) of {log} were written outside their "
              f"job's start and finish (a later run rewrote them), e.g. {stale[0]}; those jobs count with the "
              "log's times (1 s resolution) and no CPU time. Profile a run right after it ends.", file=sys.stderr)
    return Run(log=log, jobs=jobs, elapsed_s=elapsed)


#: Slack around a job's logged start and finish (1 s stamps; the file is written as the job ends).
_WRITE_SLACK_S = 5.0


def _written_by(job: Job, path: Path) -> bool:
    """Whether the benchmark file was last written during this job (its mtime within the job's log window)."""
    if job.started is None or job.finished is None:
        return True
    written = dt.datetime.fromtimestamp(path.stat().st_mtime)
    return (job.started - dt.timedelta(seconds=_WRITE_SLACK_S) <= written
            <= job.finished + dt.timedelta(seconds=_WRITE_SLACK_S))


def per_rule(run: Run) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for job in run.jobs:
        row = table.setdefault(job.rule, {"jobs": 0, "wall": 0.0, "cpu": 0.0})
        row["jobs"] += 1
        row["wall"] += job.wall_s or 0.0
        row["cpu"] += job.cpu_s or 0.0
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["wall"]))


def _ratio(after: float, before: float) -> str:
    return f"{after / before:5.2f}x" if before > 0 else "    -"


def report(run: Run, baseline: Run | None = None, out=None) -> None:
    out = sys.stdout if out is None else out
    rows = per_rule(run)
    base = per_rule(baseline) if baseline else {}
    total_wall = sum(r["wall"] for r in rows.values())
    total_cpu = sum(r["cpu"] for r in rows.values())
    print(f"run {run.log}: {len(run.jobs)} jobs, elapsed "
          f"{'?' if run.elapsed_s is None else f'{run.elapsed_s:.0f} s'}, "
          f"job wall {total_wall:.0f} s, job CPU {total_cpu:.0f} s", file=out)
    if baseline:
        b_wall = sum(r["wall"] for r in base.values())
        print(f"baseline {baseline.log}: {len(baseline.jobs)} jobs, elapsed "
              f"{'?' if baseline.elapsed_s is None else f'{baseline.elapsed_s:.0f} s'}, job wall {b_wall:.0f} s",
              file=out)
        if run.elapsed_s and baseline.elapsed_s:
            print(f"elapsed after/before: {run.elapsed_s / baseline.elapsed_s:.2f}x", file=out)
    header = f"{'rule':36s} {'jobs':>4s} {'wall s':>8s} {'mean s':>7s} {'cpu s':>7s}"
    if baseline:
        header += f"  {'before':>11s} {'wall':>6s} {'cpu':>6s}"
    print(header, file=out)
    for rule in list(rows) + [r for r in base if r not in rows]:
        r = rows.get(rule, {"jobs": 0, "wall": 0.0, "cpu": 0.0})
        line = (f"{rule:36s} {r['jobs']:4d} {r['wall']:8.1f} "
                f"{(r['wall'] / r['jobs'] if r['jobs'] else 0):7.1f} {r['cpu']:7.1f}")
        if baseline:
            b = base.get(rule, {"jobs": 0, "wall": 0.0, "cpu": 0.0})
            line += f"  {b['jobs']:3d}x{(b['wall'] / b['jobs'] if b['jobs'] else 0):6.1f}s"
            line += f" {_ratio(r['wall'], b['wall'])} {_ratio(r['cpu'], b['cpu'])}"
        print(line, file=out)
def _newest_log(root: Path) -> Path:
    logs = sorted((root / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        raise SystemExit(f"profile_pipeline: no snakemake log under {root}/.snakemake/log; run snakemake first "
                         "or pass --log FILE")
    return logs[-1]


def _root_of(log: Path, given: str | None) -> Path:
    if given:
        return Path(given)
    parent = log.resolve().parent
    return parent.parent.parent if parent.name == "log" and parent.parent.name == ".snakemake" else Path(".")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", help="snakemake log of the run (default: the newest under .snakemake/log)")
    ap.add_argument("--root", help="working directory of that run (default: from the log's path)")
    ap.add_argument("--baseline", help="snakemake log of the run to compare against")
    ap.add_argument("--root-baseline", help="working directory of the baseline run")
    args = ap.parse_args(argv)
    log = Path(args.log) if args.log else _newest_log(Path("."))
    for path in [log] + ([Path(args.baseline)] if args.baseline else []):
        if not path.exists():
            raise SystemExit(f"profile_pipeline: {path} does not exist")
    root = _root_of(log, args.root)
    run = read_run(log, root)
    baseline = None
    if args.baseline:
        b = Path(args.baseline)
        b_root = _root_of(b, args.root_baseline)
        baseline = read_run(b, b_root)
    report(run, baseline)


if __name__ == "__main__":
    main()
