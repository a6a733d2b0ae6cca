"""Settings of the whole test session, the lane guard, and shared fixtures.

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
#: built, which `userdp run` does in the test process to read its arguments (userdp.snakemake_args).
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


# ---------------------------------------------------------------- shared fixtures
#
# Folders that several test files build the same way. Pure helpers (file-format builders, brute-force
# references, accounting shorthands, the catalogue table) stay modules: train_fixtures.py, builders.py,
# eval_builders.py, clipping_fixtures.py, privacy_helpers.py, proc_helpers.py, leak_scan.py,
# bad_input_catalogue.py. Heavy imports stay inside the fixtures: this file is loaded by every run.


@pytest.fixture
def aggregate_cells(tmp_path):
    """A finished evaluation stage in tmp_path: the small grid's plans, ledgers, metrics and train logs.

    Attributes: root (tmp_path), config (validated: dataset toy, eps 1 and 4 plus inf, one budget, a G sweep
    cell per method, two learning rates), cells (the grid's cells), inputs (rule aggregate's inputs, paths).
    """
    import types

    import pandas as pd

    from eval_builders import plan_record
    from userdp.config import validate_config
    from userdp.io import write_json
    from userdp.grid import iter_cells

    config = validate_config({
        "datasets": {"toy": {"source": "synthetic"}},
        "grid": {"epsilons": [1, 4], "budgets": [{"compute": 100, "steps": 5}], "seeds": [0],
                 "group_size_sweep": [2]},
        "training": {"learning_rates": [0.001, 0.01]},
    })
    cells = list(iter_cells(config))
    for i, cell in enumerate(cells):
        g = cell.group_size or (4 if cell.method == "els" else 8)
        write_json(tmp_path / cell.plan_path, plan_record(cell.method, cell.epsilon, group_size=g,
                                                          group_size_rule="sweep" if cell.group_size else "median"))
        run = tmp_path / cell.run_dir
        write_json(run / "ledger.json", {"method": cell.method, "steps_completed": 5,
                                         "versions": {"torch": "2.13.0"}, "epsilon": cell.epsilon})
        write_json(run / "metrics.json", {"test_loss": 3.0 + i, "validation_loss": 3.1 + i, "learning_rate": 0.01,
                                          "learning_rate_sweep": [{"learning_rate": 0.01, "validation_loss": 3.1}]})
        pd.DataFrame({"step": range(1, 6), "loss": [5, 4, 3, 2, 1.0]}).to_parquet(run / "train_log.parquet")
    # rule aggregate's inputs: each cell's plan, metrics, ledger and train log, in grid order
    inputs = {"plans": [str(tmp_path / c.plan_path) for c in cells],
              **{k: [str(tmp_path / c.run_dir / name) for c in cells]
                 for k, name in (("metrics", "metrics.json"), ("ledgers", "ledger.json"),
                                 ("train_logs", "train_log.parquet"))}}
    return types.SimpleNamespace(root=tmp_path, config=config, cells=cells, inputs=inputs)


#: The training stage's tiny config (fixture train_stage): 2 cells (ELS, ULS at eps 8), 3 steps each.
TRAIN_STAGE_CONFIG = {
    "seed": 0,
    "datasets": {"tiny": {"source": "synthetic", "split": {"validation": 0.2, "test": 0.1}}},
    "tokenizer": {"sequence_length": 12, "public_dataset": "tiny", "vocab_size": 300},
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "pretrain": {"steps": 20, "batch_size": 8}},
    "grid": {"datasets": ["tiny"], "methods": ["els", "uls"], "epsilons": [8], "nonprivate": False,
             "budgets": [{"compute": 24, "steps": 3}], "seeds": [0]},
    "training": {"learning_rates": [0.001], "physical_batch_size": 4, "checkpoint_every": 2, "threads": 1,
                 "device": "cpu"},
}


@pytest.fixture
def train_stage(tmp_path):
    """The training stage's inputs in tmp_path, as the data and plan stages would leave them.

    A tokenizer, tokens and public tokens of dataset tiny, a plan per cell (epsilon from the real
    accountant), extra.yaml (TRAIN_STAGE_CONFIG) and a Snakefile with only common.smk and train.smk.
    Attributes: root, raw (a copy of TRAIN_STAGE_CONFIG), config (validated), and snakemake(*args): the real
    snakemake on that Snakefile (integration tests only: the lane guard refuses it elsewhere).
    """
    import copy
    import types

    import pyarrow.parquet as pq
    import yaml

    from privacy_helpers import epsilon_of
    from train_fixtures import make_tokenizer, public_tokens_table, tokens_table
    from userdp.config import validate_config
    from userdp.grid import iter_cells
    from userdp.privacy.spec import RunSpec
    from userdp.training.pool import build_pool

    root = tmp_path
    repo = Path(__file__).resolve().parents[1]
    raw = copy.deepcopy(TRAIN_STAGE_CONFIG)
    config = validate_config(copy.deepcopy(raw))
    seq = raw["tokenizer"]["sequence_length"]
    vocab = make_tokenizer(root / "results/tokenizer")
    tokens = tokens_table(40, seed=5, vocab=vocab, max_len=seq)
    (root / "results/data/tiny").mkdir(parents=True, exist_ok=True)
    pq.write_table(tokens, root / "results/data/tiny/tokens.parquet")
    pq.write_table(public_tokens_table(vocab, n=100), root / "results/data/tiny/public_tokens.parquet")
    train = tokens.filter(tokens["split"].to_pandas().eq("train").to_numpy())
    for cell in iter_cells(config):
        G = 2 if cell.method == "els" else 3
        pool = build_pool(train.select(["user_id", "example_id", "input_ids"]), G, seed=0)
        n = pool.n_examples if cell.method == "els" else pool.n_users
        expected = 4.0 if cell.method == "els" else 2.0
        q, sigma, delta = expected / n, 1.0, 1e-3
        RunSpec(
            dataset=cell.dataset, method=cell.method, epsilon=cell.epsilon, delta=delta, group_size=G,
            sampling_rate=q, steps=cell.steps, expected_batch=expected, noise_multiplier=sigma,
            epsilon_achieved=epsilon_of(cell.method, sigma, q, cell.steps, delta,
                                        group_size=G if cell.method == "els" else 1),
            compute_budget=cell.compute, accountant="pld", group_size_rule="explicit", clip_norm=1.0, clipping="flat",
        ).write(root / cell.plan_path)
    (root / "extra.yaml").write_text(yaml.safe_dump(raw))
    (root / "Snakefile").write_text(
        f'include: "{repo}/workflow/rules/common.smk"\n'
        f'include: "{repo}/workflow/rules/train.smk"\n\n'
        "rule all:\n    input:\n        train_targets(),\n    default_target: True\n"
    )

    def snakemake(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "--directory", str(root),
               "--configfile", str(root / "extra.yaml"), "--cores", "2", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)

    return types.SimpleNamespace(root=root, raw=raw, config=config, snakemake=snakemake)
