"""Snakemake's command line as `userdp run` checks it before it starts snakemake.

Snakemake's `--configfile` and `--config` take several values, and argparse
gives every plain word after them to the option: `snakemake --configfile
my.yaml results/x.json` reads the target as a second config file and stops
with a FileNotFoundError traceback. Write `--configfile=my.yaml` (the `=`
ends the option) or put the targets first. `userdp run` reads the command
line with snakemake's own parser (`snakemake.cli.get_argument_parser`) and
refuses one whose `--configfile` or `--config` values hold a target, saying
how to write it (`swallowed_targets`); it runs snakemake with the arguments
as given.
"""

from __future__ import annotations

import argparse
import os
from pathlib import PurePath
from typing import Sequence

from .errors import UserError
from .layout import DOWNLOADS

#: Folders the workflow writes into: a .json file there is a target, not a config file.
OUTPUT_FOLDERS = ("results", DOWNLOADS)
#: Arguments that make snakemake print and exit: no config is read.
INFO_ARGS = frozenset({"-h", "--help", "-v", "--version"})


def is_config_file(word: str) -> bool:
    """Whether `word` names a config file (.yaml/.yml, or .json outside the output folders) rather than a
    target."""
    if word.lower().endswith((".yaml", ".yml")):
        return True
    return word.lower().endswith(".json") and PurePath(os.path.normpath(word)).parts[0] not in OUTPUT_FOLDERS


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` as snakemake reads it (its parser exits 2 with its message on an unknown option)."""
    from snakemake.cli import get_argument_parser

    return get_argument_parser().parse_args(list(argv))


def swallowed_targets(args: argparse.Namespace) -> None:
    """A UserError for targets that snakemake would read as `--configfile` or `--config` values."""
    files = [str(f) for f in args.configfile or []]
    targets = [f for f in files[1:] if not is_config_file(f)]
    targets += [c for c in args.config or [] if "=" not in c]
    if targets:
        first = files[0] if files else "FILE"
        raise UserError(
            f"{targets} follow --configfile/--config, so snakemake would read them as config files or KEY=VALUE "
            f"entries, not as targets; put the targets first, or end the option with '=' "
            f"(--configfile={first} {' '.join(targets)}).")


def run_snakemake(argv: Sequence[str]) -> int:
    """Run `python -m snakemake ARGV` with this interpreter in the current folder; its exit status.

    Ctrl-C reaches snakemake from the terminal (same process group) and is ignored here, so snakemake
    stops its jobs and exits in its own time; a SIGTERM sent to this process is passed on to it. A
    snakemake killed by signal N gives 128 + N, as a shell reports it.
    """
    import signal
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "snakemake", *argv])
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))}
    try:
        status = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - status if status < 0 else status
