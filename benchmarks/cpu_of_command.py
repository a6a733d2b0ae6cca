"""How much CPU a command and everything it starts used, and how busy the machine was meanwhile.

    .venv/bin/python benchmarks/cpu_of_command.py -- .venv/bin/snakemake --cores 2

Prints the command's wall time, the user + system CPU seconds of the command and all its descendants
(getrusage of the waited children: every job of a snakemake run, and snakemake itself), that CPU per
wall second (the cores it kept busy on average), and the machine's idle share over the same interval
(/proc/stat; the other processes' CPU is the rest). Next to `benchmarks/profile_pipeline.py`, which sums
the CPU of each job's benchmark file, the difference is what no job's benchmark counts: snakemake's own
process, and each job's start outside its benchmark. Ratios against a run in the same session only:
these machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def _proc_stat() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    idle0, total0 = _proc_stat()
    t0 = time.monotonic()
    rc = subprocess.call(command)
    wall = time.monotonic() - t0
    idle1, total1 = _proc_stat()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    idle_share = (idle1 - idle0) / max(1, total1 - total0)
    print(f"exit status {rc}; wall {wall:.1f} s; CPU of the command and its descendants {cpu:.1f} s "
          f"(user {usage.ru_utime:.1f}, system {usage.ru_stime:.1f}); {cpu / wall:.2f} cores busy on average "
          f"of {os.cpu_count()}; machine idle {idle_share:.1%} of the time", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
