"""Snakemake's command line, put in an order it reads as meant (`python -m userdp run`).

Snakemake's targets are a positional list, and several of its options take
a variable number of values (`--configfile a.yaml b.yaml`, `--config k=v
...`). argparse gives every plain word after such an option to the option,
so `snakemake --configfile my.yaml results/x.json` reads the target as a
second config file and stops with a FileNotFoundError traceback. Targets
must come before those options; `order_args` moves them there.

Which options take how many values is read from snakemake's own argument
parser (`snakemake.cli.get_argument_parser`), so it follows the installed
version. A word after a variable-length option is taken for a target only
where the option's values have a form it lacks:

- `--configfile`/`--configfiles`: a config file ends in .yaml or .yml, or in
  .json outside the workflow's output folders (`results/x.json` and
  `data/x/download.json` are targets); the first value always stays (the
  option needs one);
- options whose values are NAME=VALUE (`--config`, `--resources`,
  `--set-threads`, ... : a `=` in snakemake's metavar, and `--groups`,
  `--group-components`): a word without `=`;
- options with a fixed set of choices (`--quiet`, `--rerun-triggers`, ...,
  also `--dag` and the like that take at most one): a word not among them.

Values that look like targets (rule names and files, e.g. of `--forcerun`,
`--until`, `--allowed-rules`) stay where they are: nothing tells them apart,
so targets still go before those options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Mapping, Sequence

from .layout import DOWNLOADS

#: Folders the workflow writes into: a .json file there is a target, not a config file.
OUTPUT_FOLDERS = ("results", DOWNLOADS)
#: Options that take NAME=VALUE values although snakemake's metavar does not show it.
_KEY_VALUE_DESTS = frozenset({"groups", "group_components"})


def is_config_file(word: str) -> bool:
    """Whether `word` names a config file (see the module) rather than a target."""
    if word.lower().endswith((".yaml", ".yml")):
        return True
    return word.lower().endswith(".json") and PurePath(os.path.normpath(word)).parts[0] not in OUTPUT_FOLDERS


@dataclass(frozen=True)
class Option:
    """How many values one of snakemake's options takes, and what they look like."""

    nargs: int | str  # 0 (a flag), an int, "?", "*" or "+"
    dest: str
    choices: frozenset[str] | None = None
    key_value: bool = False

    def is_value(self, word: str) -> bool:
        """Whether `word` can be a value of this option (False: it is a target)."""
        if self.dest == "configfile":
            return is_config_file(word)
        if self.key_value:
            return "=" in word
        if self.choices is not None:
            return word in self.choices
        return True


def snakemake_options() -> dict[str, Option]:
    """Option string -> Option, for every option of the installed snakemake's parser."""
    from snakemake.cli import get_argument_parser

    out: dict[str, Option] = {}
    for action in get_argument_parser()._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if not action.option_strings:
            continue
        choices = None
        if action.choices is not None:
            choices = frozenset(str(getattr(c, "value", c)) for c in action.choices)
        key_value = "=" in str(action.metavar or "") or action.dest in _KEY_VALUE_DESTS
        # nargs None: one value (flags, counts, help and version have nargs 0)
        spec = Option(1 if action.nargs is None else action.nargs, action.dest, choices, key_value)
        for opt in action.option_strings:
            out[opt] = spec
    return out


@dataclass(frozen=True)
class SnakemakeArgs:
    """A snakemake command line in reading order: targets first, then the options as given."""

    argv: list[str]
    targets: list[str] = field(default_factory=list)
    configfiles: list[str] = field(default_factory=list)
    config: list[str] = field(default_factory=list)  # the --config KEY=VALUE entries
    moved: list[str] = field(default_factory=list)  # targets that stood among an option's values
    given: frozenset[str] = frozenset()  # the dests of the options given (e.g. "replace_workflow_config")


def _lookup(options: Mapping[str, Option], word: str) -> tuple[Option | None, str | None]:
    """(the option `word` names, its attached value) for `--opt`, `--opt=v`, a unique prefix of a long
    option (as argparse allows), `-x` and `-xVALUE`; (None, None) for an unknown option."""
    if word.startswith("--"):
        name, eq, value = word.partition("=")
        if name in options:
            return options[name], value if eq else None
        hits = {o for o in options if o.startswith(name)}
        specs = {id(options[o]) for o in hits}
        if len(specs) == 1:
            return options[hits.pop()], value if eq else None
        return None, None
    if word[:2] in options:
        rest = word[2:]
        return options[word[:2]], (rest.removeprefix("=") if rest else None)
    return None, None


def order_args(args: Sequence[str], options: Mapping[str, Option] | None = None) -> SnakemakeArgs:
    """`args` with every target moved before the options, each option keeping its values (see the module).

    `options` is what `snakemake_options()` returns (read when not given). Words after `--` are targets too
    (left after it, at the end, if one of them starts with a dash).
    """
    options = snakemake_options() if options is None else options
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    targets: list[str] = []
    moved: list[str] = []
    rest: list[str] = []
    values: dict[str, list[str]] = {"configfile": [], "config": []}
    given: set[str] = set()
    i = 0
    while i < end:
        word = args[i]
        i += 1
        if not word.startswith("-") or word == "-":
            targets.append(word)
            continue
        rest.append(word)
        spec, attached = _lookup(options, word)
        if spec is not None and spec.nargs == 0 and not word.startswith("--"):
            # one-letter flags run together (-np), the last perhaps with a value (-nj2, -nq rules)
            for k in range(2, len(word)):
                given.add(spec.dest)
                spec, attached = options.get("-" + word[k]), (word[k + 1:] or None)
                if spec is None or spec.nargs != 0:
                    break
        if spec is not None:
            given.add(spec.dest)
        if spec is None or spec.nargs == 0:
            continue  # a flag, or unknown (snakemake will say so)
        if attached is not None:
            values.get(spec.dest, []).append(attached)
            continue
        # the words argparse gives it: up to its count, stopping at the next option
        limit = {"?": 1, "*": end, "+": end}.get(spec.nargs, spec.nargs)  # type: ignore[arg-type]
        taken = 0
        while i < end and taken < limit and (not args[i].startswith("-") or args[i] == "-"):
            value = args[i]
            i += 1
            # a fixed count is taken whatever it is; the first of --configfile is the file it needs
            if isinstance(spec.nargs, int) or spec.is_value(value) or (taken == 0 and spec.dest == "configfile"):
                rest.append(value)
                values.get(spec.dest, []).append(value)
                taken += 1
            else:
                targets.append(value)
                moved.append(value)
    tail = args[end:]
    if not any(w.startswith("-") for w in tail[1:]):  # argparse reads one run of targets: join them
        targets, tail = targets + tail[1:], []
    return SnakemakeArgs([*targets, *rest, *tail], targets + tail[1:], values["configfile"], values["config"],
                         moved, frozenset(given))


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
