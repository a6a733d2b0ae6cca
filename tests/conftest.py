"""Settings of the whole test session and the lane guard.

Bytecode caching. Some environments (this project's build machines among
them) set PYTHONDONTWRITEBYTECODE=1, so every Python process recompiles the
modules it imports from source: each snakemake job an integration test
starts then spends about 15 s of CPU compiling torch and transformers before
it does anything. The tests let Python cache bytecode (in `__pycache__`
folders, which git ignores), in this process and in every process it starts,
so that cost is paid once per checkout. Results do not depend on it.

Test lanes (tests/README.md). The fast lane is `pytest -m "not integration"`.
A test that is not marked `integration` may not start snakemake, the userdp
command line, torchrun, a workflow script or torch's multi-process training,
and may start no other process unless it is marked `helper_process`: the
guard below refuses the start and fails the test with what to mark.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The accountant memo (userdp.privacy.memo) is the pipeline's: tests compute every epsilon afresh, and the
# snakemake runs they start set their own (under their working directory) from the Snakefile.
os.environ.pop("USERDP_ACCOUNTING_MEMO", None)


# ---------------------------------------------------------------- the lane guard

#: `python -m NAME` modules and executables that run the pipeline or a part of it.
PIPELINE_MODULES = ("snakemake", "userdp", "torch.distributed.run", "torch.distributed.launch")
PIPELINE_PROGRAMS = ("snakemake", "userdp", "torchrun")

#: Probes any test may run: snakemake's SLURM executor plugin runs them when snakemake's command-line parser is
#: built, which `userdp run` does in the test process to read snakemake's options (userdp.snakemake_args).
PROBES = (("which",), ("scontrol", "show", "config"))

_running: dict[str, pytest.Item | None] = {"item": None}  # the test whose setup, call or teardown runs now


def _words(args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    return [os.fsdecode(a) for a in args]


def pipeline_command(args) -> str | None:
    """What in the command line `args` (as given to subprocess.Popen) runs the pipeline, or None."""
    words = _words(args)
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            module = words[i + 1]
            if module in PIPELINE_MODULES or module.split(".")[0] in ("snakemake", "userdp"):
                return f"python -m {module}"
        name = Path(word).name
        if name in PIPELINE_PROGRAMS:
            return name
        if "workflow/scripts/" in word.replace(os.sep, "/") or "/.snakemake/scripts/" in word:
            return f"the workflow script {name}"
    return None


def lane_refusal(args, marks: set[str]) -> str | None:
    """Why a test with markers `marks` may not start `args` (None: it may)."""
    if "integration" in marks:
        return None
    words = _words(args)
    if any(tuple(Path(w).name if i == 0 else w for i, w in enumerate(words[:len(p)])) == p for p in PROBES):
        return None
    what = pipeline_command(args)
    if what is not None:
        return f"starts {what}; mark this test integration"
    if "helper_process" not in marks:
        return ("starts a process; mark this test integration (or helper_process if the process is a short "
                "helper that runs no pipeline stage: a signal target, a fresh interpreter, git)")
    return None


def _refuse(reason: str, args) -> None:
    item = _running["item"]
    shown = " ".join(_words(args))
    pytest.fail(f"{item.nodeid if item else 'a test'} {reason} (tests/README.md, 'Test lanes'); command: "
                f"{shown[:300]}", pytrace=False)


class _GuardedPopen(subprocess.Popen):
    """subprocess.Popen (so also run, call, check_output) that asks the lane guard first."""

    def __init__(self, args, *rest, **kwargs):
        item = _running["item"]
        if item is not None:
            reason = lane_refusal(args, {m.name for m in item.iter_markers()})
            if reason is not None:
                _refuse(reason, args)
        super().__init__(args, *rest, **kwargs)


_spawners: dict[str, object] = {}


def _guard_torch_spawn() -> None:
    """torch.multiprocessing.spawn / start_processes (multi-process training) for integration tests only.

    Patched once torch is loaded (`import torch` loads torch.multiprocessing; collecting the suite loads
    torch): a test whose module imports torch only inside the test body is not covered for this call.
    """
    tmp = sys.modules.get("torch.multiprocessing")
    if tmp is None or _spawners:
        return
    for name in ("spawn", "start_processes"):
        real = getattr(tmp, name, None)
        if real is None:
            continue
        _spawners[name] = real

        def guarded(*args, _real=real, _name=name, **kwargs):
            item = _running["item"]
            if item is not None and item.get_closest_marker("integration") is None:
                _refuse("starts multi-process training; mark this test integration",
                        [f"torch.multiprocessing.{_name}"])
            return _real(*args, **kwargs)

        setattr(tmp, name, guarded)


def pytest_configure(config):
    subprocess.Popen = _GuardedPopen


def pytest_unconfigure(config):
    subprocess.Popen = _GuardedPopen.__mro__[1]
    tmp = sys.modules.get("torch.multiprocessing")
    for name, real in _spawners.items():
        setattr(tmp, name, real)
    _spawners.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Attribute every process start during the test (its fixtures' setup included) to the test."""
    _guard_torch_spawn()
    _running["item"] = item
    try:
        return (yield)
    finally:
        _running["item"] = None


# ---------------------------------------------------------------- per-test state


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with torch on one thread and leaves it so.

    The tests share 2 cores (tests/train_fixtures.py sets one thread); code under test may set more
    (userdp.training.finetune_job, the evaluate/pretrain scripts run in-process set the job's `threads`).
    Left at 2 on a busy machine, every later training test ran 10-40 times slower (test_train_engine's
    resume test: 0.9 s alone, 36 s after test_train_distributed).
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
