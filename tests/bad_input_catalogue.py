"""The bad-input catalogue: one table of bad inputs a user can produce, run as tests, listed in the docs.

Every row (`Case`) is one bad input: a config key, a data file, a command-line argument, a model folder or a
corrupted pipeline artifact. Running a case builds the input in a fresh temporary folder (`setup`), runs the real
entry point on it in-process (`run`: a config load, a pipeline script or library stage through
`userdp.errors.run_main`, `userdp.cli.main`, or -- for a few -- a real `snakemake -n`), and records the exit status
and what was printed. tests/test_catalogue.py asserts, per case:

- the exit status (`exit`: 2 for a `UserError` through `run_main` or the CLI, 1 for snakemake's start-up errors);
- a substring of the message (`message`), which names the file or the key, and none of `unwanted` (a wrong hint);
- no traceback in the output of a clean error;
- that `absent` paths (half-written outputs, temporary files) do not exist afterwards, nor any temporary file of
  an atomic write anywhere (`TEMP_PATTERNS`);
- that `kept` paths (files the user had before) still exist with the same bytes.

A case that does not meet the standard today is kept with the expectation it should meet, marked `xfail` with a
`reason` (the test is then a strict xfail: it fails once the gap is fixed, so the mark must go).

`python tests/bad_input_catalogue.py > docs/catalogue.md` runs every case and writes the docs page.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "workflow", Path(__file__).resolve().parent):  # userdp and the fixture builders, also as a script
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

KINDS = ("config", "data", "cli", "model", "artifact")
KIND_TITLES = {
    "config": "Config (config.yaml, --configfile, --config)",
    "data": "Data files (datasets.<name>.path and public corpora)",
    "cli": "Command line (python -m userdp)",
    "model": "Model and tokenizer folders (model.name, tokenizer.name, LoRA adapters)",
    "artifact": "Corrupted pipeline artifacts (results/)",
}

#: Temporary files of atomic writes (userdp.io.atomic_path, save_model_atomic, the tokenizer's and prepare's
#: scratch files): none may be left anywhere after any case.
TEMP_PATTERNS = ("**/.*.tmp", "**/.*.tmp-*", "**/.tokenizer.*", "**/.examples.pass1.parquet")


# ---------------------------------------------------------------- the table's row


@dataclass(frozen=True)
class Outcome:
    """What running a case gave: the exit status and everything printed (stderr, then stdout)."""

    exit: int
    output: str


@dataclass(frozen=True)
class Case:
    id: str  #: short, kebab-case, unique
    kind: str  #: one of KINDS
    what: str  #: the bad input, as a user would describe it
    run: Callable[[Path], Outcome]  #: runs the real entry point in the case's folder (the working directory)
    exit: int  #: expected exit status
    message: str  #: a substring of the error message, naming the file or key
    setup: Callable[[Path], None] | None = None  #: builds the bad input (and the user's other files) in the folder
    absent: tuple[str, ...] = ()  #: relative paths or globs that must not exist afterwards
    kept: tuple[str, ...] = ()  #: relative paths (files or folders) the user had: same bytes afterwards
    unwanted: tuple[str, ...] = ()  #: substrings that must NOT be in the output (a wrong hint)
    xfail: bool = False  #: a known gap: today's behaviour does not meet the expectation
    reason: str = ""  #: for xfail: what happens today and where


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    leftovers: tuple[str, ...]  #: absent paths (or temporary files) that exist afterwards
    changed: tuple[str, ...]  #: kept paths that are gone or whose bytes changed

    @property
    def text(self) -> str:
        return self.outcome.output


def _snapshot(path: Path) -> dict[str, bytes] | None:
    if path.is_file():
        return {"": path.read_bytes()}
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return None


def execute(case: Case, folder: str | os.PathLike) -> Result:
    """Set up and run `case` in `folder` (an empty temporary folder); what it printed, left behind and changed."""
    folder = Path(folder)
    with contextlib.chdir(folder):
        if case.setup is not None:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                case.setup(folder)
        before = {k: _snapshot(folder / k) for k in case.kept}
        missing = [k for k, v in before.items() if v is None]
        if missing:
            raise AssertionError(f"case {case.id}: kept path(s) {missing} were not created by its setup")
        existing = sorted({str(p.relative_to(folder)) for pat in case.absent for p in folder.glob(pat)})
        if existing:
            raise AssertionError(f"case {case.id}: absent path(s) {existing} exist before the run")
        outcome = case.run(folder)
    leftovers = sorted({str(p.relative_to(folder)) for pat in (*case.absent, *TEMP_PATTERNS) for p in folder.glob(pat)})
    changed = tuple(k for k, v in before.items() if _snapshot(folder / k) != v)
    return Result(outcome, tuple(leftovers), changed)


# ---------------------------------------------------------------- runners


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("text") prints it and exits 1
    return 1


@contextlib.contextmanager
def _kept_sigterm():
    """run_main installs a SIGTERM handler; give the process its own back afterwards."""
    old = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _capture(call: Callable[[], Any]) -> Outcome:
    """Run `call` like a script's top level: its return value or SystemExit is the status; an uncaught
    exception prints its traceback and is status 1 (what Python does)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), _kept_sigterm():
        try:
            rc = call()
            status = rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
        except SystemExit as exc:
            status = _exit_status(exc.code)
        except Exception:
            traceback.print_exc(file=err)
            status = 1
    return Outcome(status, err.getvalue() + out.getvalue())


def job(fn: Callable[[Path], Any]) -> Callable[[Path], Outcome]:
    """fn(folder) through userdp.errors.run_main, the way every pipeline script runs its work."""

    def run(folder: Path) -> Outcome:
        from userdp.errors import run_main

        return _capture(lambda: run_main(lambda: fn(folder)))

    return run


def cli(command: str = "") -> Callable[[Path], Outcome]:
    """`python -m userdp COMMAND` in-process (the words split like a shell's): userdp.cli.main's return value (or
    argparse's SystemExit)."""
    argv = shlex.split(command)

    def run(folder: Path) -> Outcome:
        from userdp.cli import main

        return _capture(lambda: main(list(argv)))

    return run


class _Names(list):
    """Snakemake's named lists (input, output, params, wildcards, log), as far as the scripts use them."""

    def __init__(self, **named: Any):
        super().__init__(named.values())
        self._named = named
        self.__dict__.update(named)

    def items(self):
        return self._named.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._named.get(key, default)


@contextlib.contextmanager
def _process_state():
    """What a script may change for the whole process (environment variables, pyarrow's thread count) restored."""
    import pyarrow as pa

    env, cpus = dict(os.environ), pa.cpu_count()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        pa.set_cpu_count(cpus)


@contextlib.contextmanager
def _script_logging():
    """The scripts' setup_logging (which reconfigures the root logger) replaced by a quiet logger."""
    import userdp.logutil as logutil

    quiet = logging.getLogger("userdp.catalogue.script")
    quiet.propagate = False
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
    original = logutil.setup_logging
    logutil.setup_logging = lambda *args, **kwargs: quiet
    try:
        yield
    finally:
        logutil.setup_logging = original


def script(name: str, make: Callable[[Path, dict], dict], config: dict | None = None) -> Callable[[Path], Outcome]:
    """Run workflow/scripts/NAME as Snakemake runs it, in-process, with a `snakemake` object from `make`.

    With `config` the config is first validated as the workflow does at start-up (a ConfigError exits 2 there
    and the script does not run); `make(folder, validated config)` returns the rule's input, output, params,
    wildcards (dicts) and threads; the stand-in's `config` is the validated config, which the scripts read only
    through userdp.untracked (tests/test_structure.py).
    """

    def run(folder: Path) -> Outcome:
        from userdp.config import validate_config
        from userdp.errors import run_main

        path = REPO / "workflow" / "scripts" / name
        code = compile(path.read_text(encoding="utf-8"), str(path), "exec")

        def go() -> None:
            cfg = copy.deepcopy(config) if config is not None else {}
            if config is not None:
                run_main(lambda: validate_config(cfg, source="config"))
            rule = make(folder, cfg)
            sm = type("Snakemake", (), {})()
            for key in ("input", "output", "params", "wildcards"):
                setattr(sm, key, _Names(**rule.get(key, {})))
            sm.log = _Names(log=f"logs/{name}.log")
            sm.threads, sm.rule = rule.get("threads", 1), rule.get("rule", name)
            sm.config = cfg
            with _script_logging(), _process_state():
                exec(code, {"__name__": "__main__", "__file__": str(path), "snakemake": sm})

        return _capture(go)

    return run


def snakemake(*args: str) -> Callable[[Path], Outcome]:
    """A real `snakemake -n` on the repository's Snakefile with the case's folder as working directory (slow:
    keep these few)."""

    def run(folder: Path) -> Outcome:
        argv = [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "-s", str(REPO / "Snakefile"),
                "--directory", str(folder), *args]
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300, env=env)
        return Outcome(proc.returncode, proc.stderr + proc.stdout)

    run.starts_snakemake = True  # tests/test_catalogue.py puts these cases in the integration lane
    return run


# ---------------------------------------------------------------- file builders


def write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")

    return setup


def gzip_file(rel: str) -> Callable[[Path], None]:
    """Compress an existing file with gzip into `rel`.gz (the original removed)."""

    def setup(folder: Path) -> None:
        import gzip

        p = folder / rel
        (folder / f"{rel}.gz").write_bytes(gzip.compress(p.read_bytes()))
        p.unlink()

    return setup


def saved_dataset_dict(rel: str) -> Callable[[Path], None]:
    """A folder written by `datasets.DatasetDict.save_to_disk` with train and test splits."""

    def setup(folder: Path) -> None:
        import datasets

        from builders import LOCAL_ROWS
        datasets.DatasetDict({"train": datasets.Dataset.from_list(LOCAL_ROWS),
                              "test": datasets.Dataset.from_list(LOCAL_ROWS[:2])}).save_to_disk(str(folder / rel))

    return setup


def steps(*setups: Callable[[Path], None] | None) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        for s in setups:
            if s is not None:
                s(folder)

    return setup


def truncate(rel: str, keep: float = 0.5) -> Callable[[Path], None]:
    """Cut an existing file to a fraction of its bytes (a killed copy, a full disk)."""

    def setup(folder: Path) -> None:
        p = folder / rel
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])

    return setup


def parquet(rel: str, columns: dict[str, list], metadata: dict | None = None) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table(columns)
        if metadata is not None:
            table = table.replace_schema_metadata(metadata)
        pq.write_table(table, p)

    return setup


def tokens(rel: str = "results/data/mine/tokens.parquet", **kwargs: Any) -> Callable[[Path], None]:
    """A tokens.parquet as the tokenize rule writes it (train_fixtures.tokens_table), with its schema metadata."""

    def setup(folder: Path) -> None:
        import pyarrow.parquet as pq
        from train_fixtures import tokens_table

        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        table = tokens_table(12, seed=3)
        meta = kwargs.get("metadata", {"userdp": json.dumps({"vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2,
                                                              "pad_token_id": 0})})
        if meta is not None:
            table = table.replace_schema_metadata(meta)
        if "drop" in kwargs:
            table = table.drop(kwargs["drop"])
        if kwargs.get("shared_user"):
            import pyarrow as pa
            import pyarrow.compute as pc

            # the first validation user's rows get the id of a train user: one user in two splits
            split = table.column("split").to_pylist()
            users = table.column("user_id").to_pylist()
            train_user = users[split.index("train")]
            users = [train_user if s == "validation" else u for u, s in zip(users, split)]
            table = table.set_column(0, "user_id", pa.array(users, pa.string()))
            assert pc.sum(pc.equal(table.column("user_id"), train_user)).as_py() > 1
        pq.write_table(table, p)

    return setup


def local_file(rel: str, fmt: str, rows: list[dict] | None = None, **kwargs: Any) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        from builders import LOCAL_ROWS, build_local

        build_local(folder / rel, fmt, LOCAL_ROWS if rows is None else rows, **kwargs)

    return setup


def fortune_file(rel: str, quotes: list[tuple[str, str | None]]) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        from builders import build_fortune_file

        build_fortune_file(folder / rel, quotes)

    return setup


def so_sqlite(rel: str, rows: list | None = None, **kwargs: Any) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        from builders import SO_ROWS, build_tff_sqlite

        build_tff_sqlite(folder / rel, SO_ROWS if rows is None else rows, **kwargs)

    return setup


def so_lzma(rel: str, cut: float | None = None) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        from builders import build_tff_sqlite, lzma_compress

        with tempfile.TemporaryDirectory() as scratch:
            db = build_tff_sqlite(Path(scratch) / "so.sqlite")
            out = folder / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            lzma_compress(db, out)
        if cut is not None:
            truncate(rel, cut)(folder)

    return setup


def cc_news_parquet(rel: str, columns: Iterable[str] | None = None) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        from builders import CC_NEWS_COLUMNS, build_cc_news_parquet

        build_cc_news_parquet(folder / rel, columns=tuple(columns) if columns is not None else CC_NEWS_COLUMNS)

    return setup


def tiny_model(rel: str, weights: bool = True, **config: Any) -> Callable[[Path], None]:
    """A tiny GPT-2 saved with save_pretrained (config.json + model.safetensors); no hub, no network."""

    def setup(folder: Path) -> None:
        from transformers import AutoModelForCausalLM, GPT2Config

        cfg = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=64, n_positions=16, bos_token_id=1,
                         eos_token_id=2, **config)
        model = AutoModelForCausalLM.from_config(cfg)
        out = folder / rel
        model.save_pretrained(str(out))
        if not weights:
            for f in out.glob("*.safetensors"):
                f.unlink()

    return setup


def edit_json(rel: str, fn: Callable[[dict], dict]) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        p = folder / rel
        p.write_text(json.dumps(fn(json.loads(p.read_text(encoding="utf-8")))), encoding="utf-8")

    return setup


def torch_save(rel: str, obj_fn: Callable[[Path], Any]) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        import torch

        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj_fn(folder), p)

    return setup


def tokenizer_dir(rel: str = "results/tokenizer") -> Callable[[Path], None]:
    """A small byte-level BPE saved like the train_tokenizer rule (tokenizer.json, tokenizer_info.json)."""

    def setup(folder: Path) -> None:
        from userdp.data.tokenize import train_bpe

        parquet("public.parquet", {"text": ["the cat sat on the mat", "a dog ran in the park"] * 20})(folder)
        with contextlib.redirect_stderr(io.StringIO()):
            train_bpe(folder / "public.parquet", 300, folder / rel)
        (folder / "public.parquet").unlink()

    return setup


# ---------------------------------------------------------------- case builders per kind

#: The smallest valid config: one synthetic dataset; cases add the bad part.
MINIMAL_YAML = "datasets:\n  synth: {source: synthetic}\n"


def config_case(id: str, what: str, yaml_text: str, message: str, *, setup: Callable[[Path], None] | None = None,
                file: str = "config.yaml", kept: tuple[str, ...] = (), kind: str = "config", raw: bool = False,
                **kw: Any) -> Case:
    """`load_config(file)` of a config written as YAML (MINIMAL_YAML first unless the text has `datasets:` or
    `raw`)."""
    text = textwrap.dedent(yaml_text)
    if not raw and not re.search(r"^datasets:", text, re.M):
        text = MINIMAL_YAML + text

    def run_load(folder: Path) -> Any:
        from userdp.config import load_config

        return load_config(file)

    return Case(id, kind, what, job(run_load), kw.pop("exit", 2), message,
                setup=steps(write(file, text), setup), kept=(file, *kept), **kw)


def snakemake_case(id: str, what: str, yaml_text: str, message: str, *args: str, **kw: Any) -> Case:
    """`snakemake -n --configfile config/config.yaml my.yaml [args]` in the case's folder."""
    return Case(id, "config", what, snakemake("--configfile", str(REPO / "config" / "config.yaml"), "my.yaml", *args),
                kw.pop("exit", 1), message, setup=steps(write("my.yaml", textwrap.dedent(yaml_text)), kw.pop("setup", None)),
                kept=("my.yaml", *kw.pop("kept", ())), **kw)


DATA_OUTPUTS = ("results/data/{name}/examples.parquet", "results/data/{name}/users.parquet",
                "results/data/{name}/contributions.json")


def prepare_job(spec: dict, name: str = "mine") -> Callable[[Path], Outcome]:
    """Start-up validation of a config with dataset `name`, then rule prepare_data's script."""

    def make(folder: Path, cfg: dict) -> dict:
        return {
            "input": {"download": f"data/{name}/download.json"},
            "output": {"examples": f"results/data/{name}/examples.parquet",
                       "users": f"results/data/{name}/users.parquet",
                       "contributions": f"results/data/{name}/contributions.json"},
            "params": {"spec": cfg["datasets"][name], "seed": cfg["seed"], "contribution_stats_private": False},
            "wildcards": {"dataset": name},
        }

    return script("prepare_data.py", make, {"datasets": {name: spec}, "tokenizer": {"batch_rows": 4}})


def _dataset_job(script_name: str, output: dict[str, str], spec: dict, name: str, config: dict) -> Callable[[Path], Outcome]:
    """Start-up validation, then a data rule's script whose params are the dataset's spec and the seed."""

    def make(folder: Path, cfg: dict) -> dict:
        return {"input": {"download": f"data/{name}/download.json"},
                "output": {k: v.format(name=name) for k, v in output.items()},
                "params": {"spec": cfg["datasets"][name], "seed": cfg["seed"]},
                "wildcards": {"dataset": name}}

    return script(script_name, make, {"datasets": {name: spec}, **config})


def labels_job(spec: dict, name: str = "mine") -> Callable[[Path], Outcome]:
    """Start-up validation, then rule user_labels' script (each user's group label)."""
    return _dataset_job("user_labels.py", {"labels": "results/data/{name}/user_labels.parquet"}, spec, name,
                        {"tokenizer": {"batch_rows": 4}})


def public_job(spec: dict, name: str = "mine") -> Callable[[Path], Outcome]:
    """Start-up validation, then rule prepare_public's script (the dataset's public corpus)."""
    return _dataset_job("prepare_public.py", {"public": "results/data/{name}/public.parquet"}, spec, name, {})


def data_case(id: str, what: str, spec: dict, setup: Callable[[Path], None] | None, message: str, *,
              kept: tuple[str, ...] = (), name: str = "mine", public: bool = False, **kw: Any) -> Case:
    runner = public_job(spec, name) if public else prepare_job(spec, name)
    outputs = (f"results/data/{name}/public.parquet",) if public else tuple(p.format(name=name) for p in DATA_OUTPUTS)
    return Case(id, "data", what, runner, kw.pop("exit", 2), message, setup=setup,
                absent=(*outputs, *kw.pop("absent", ())), kept=kept, **kw)


def local(path: str, **extra: Any) -> dict:
    return {"source": "local", "path": path, **extra}


# ---------------------------------------------------------------- model and artifact runners


def load_model(rel: str, local_folder: bool = False) -> Callable[[Path], Outcome]:
    """userdp.training.models.load_model, the loader of every training, pretraining and evaluation job."""

    def fn(folder: Path) -> Any:
        from userdp.training import models

        return models.load_model(rel, local=local_folder)

    return job(fn)


def train_tokenizer(name: str | None, public: str = "results/data/synth/public.parquet") -> Callable[[Path], Outcome]:
    """Rule train_tokenizer's script: tokenizer.name (a hub id or folder), or a BPE on the public corpus."""

    def make(folder: Path, cfg: dict) -> dict:
        return {"input": {"public": public},
                "output": {"tokenizer": "results/tokenizer/tokenizer.json",
                           "info": "results/tokenizer/tokenizer_info.json"},
                "params": {"name": name, "vocab_size": 300},
                "threads": 1}

    return script("train_tokenizer.py", make, {"datasets": {"synth": {"source": "synthetic"}},
                                               "tokenizer": {"batch_rows": 16}})


TOKENIZER_OUTPUTS = ("results/tokenizer/tokenizer.json", "results/tokenizer/tokenizer_info.json")


def tokenize_job(examples: str = "results/data/mine/examples.parquet") -> Callable[[Path], Outcome]:
    """Rule tokenize's script (examples.parquet + results/tokenizer -> tokens.parquet)."""

    def make(folder: Path, cfg: dict) -> dict:
        return {"input": {"examples": examples, "tokenizer": "results/tokenizer/tokenizer.json"},
                "output": {"tokens": "results/data/mine/tokens.parquet"},
                "params": {"sequence_length": 16, "long_examples": "truncate"},
                "rule": "tokenize"}

    return script("tokenize_data.py", make, {"datasets": {"mine": {"source": "synthetic"}}, "tokenizer": {"batch_rows": 8}})


PLAN = "results/plan/mine/method~els/eps~8/budget~400.json"


def plan_job(private_stats: bool = False, privacy: dict | None = None, method: str = "els"
             ) -> Callable[[Path], Outcome]:
    """Rule plan's script for one cell (ELS by default) of dataset `mine` (inputs users.parquet and
    contributions.json); `privacy`: further privacy.* keys."""
    config: dict = {"datasets": {"mine": {"source": "synthetic"}}, "grid": {"budgets": [{"compute": 400, "steps": 10}]},
                    "privacy": {"group_size": {method: 2}, **(privacy or {})}}
    if private_stats:
        config["privacy"]["contribution_stats"] = {"private": True, "epsilon": 0.1}

    def make(folder: Path, cfg: dict) -> dict:
        from userdp.privacy import targets

        inputs = {"users": "results/data/mine/users.parquet", "contributions": "results/data/mine/contributions.json",
                  **({"contributions_dp": "results/data/mine/contributions_dp.json"} if private_stats else {})}
        return {"input": inputs, "output": {"plan": PLAN},
                "params": {"privacy": targets.plan_privacy_params(cfg, method, "8"), "steps": 10,
                           "reference_epsilon": targets.reference_epsilon_param(cfg, method, "8"),
                           "selection": targets.selection_param(cfg), "group_size": None},
                "wildcards": {"dataset": "mine", "method": method, "eps": "8", "budget": "400"}}

    return script("plan_cell.py", make, config)


def users_parquet(rel: str = "results/data/mine/users.parquet",
                  splits: tuple[str, ...] = ("train",) * 6 + ("validation", "test"),
                  drop: str | None = None) -> Callable[[Path], None]:
    cols = {"user_id": [f"u{i}" for i in range(len(splits))], "split": list(splits),
            "n_examples": [3] * len(splits)}
    if drop:
        cols.pop(drop)
    return parquet(rel, cols)


def contributions(rel: str = "results/data/mine/contributions.json", **n_users: int) -> Callable[[Path], None]:
    counts = {"train": 6, "validation": 1, "test": 1, **n_users}
    return write(rel, json.dumps({"dataset": "mine", "n_users": counts, "median_train": 3}))


CELL = "results/runs/mine/method~els/eps~8/budget~400/seed~0"
CELL_OUTPUTS = (f"{CELL}/metrics.json", f"{CELL}/ledger.json", f"{CELL}/train_log.parquet", f"{CELL}/users.parquet")


def select_job() -> Callable[[Path], Outcome]:
    """Rule select_lr's script for a cell with two learning-rate runs."""

    def make(folder: Path, cfg: dict) -> dict:
        runs = [f"{CELL}/lr~0.001"]
        return {"input": {"evals": [f"{r}/eval.json" for r in runs], "ledgers": [f"{r}/ledger.json" for r in runs],
                          "train_logs": [f"{r}/train_log.parquet" for r in runs],
                          "users": [f"{r}/eval_users.parquet" for r in runs]},
                "output": {"metrics": CELL_OUTPUTS[0], "ledger": CELL_OUTPUTS[1], "train_log": CELL_OUTPUTS[2],
                           "users": CELL_OUTPUTS[3]},
                "params": {"learning_rates": [0.001], "debug_step_log": False}}

    return script("select_lr.py", make)


def lr_runs(eval_text: str | None = None) -> Callable[[Path], None]:
    """The finished learning-rate run of CELL (training.learning_rates: [0.001]): eval.json, ledger.json,
    train_log.parquet."""

    def setup(folder: Path) -> None:
        for lr, loss, text in (("0.001", 4.0, eval_text),):
            run = f"{CELL}/lr~{lr}"
            ev = {"validation_loss": loss, "test_loss": loss + 0.1, "learning_rate": float(lr)}
            write(f"{run}/eval.json", json.dumps(ev) if text is None else text)(folder)
            write(f"{run}/ledger.json", json.dumps({"epsilon": 8.0, "delta": 1e-5, "noise_multiplier": 1.0,
                                                    "selection": {"accounting": "per_run"}}))(folder)
            parquet(f"{run}/train_log.parquet", {"step": [1, 2], "learning_rate": [float(lr)] * 2})(folder)
            parquet(f"{run}/eval_users.parquet", {"user_id": ["u1"], "nll": [4.0], "n_tokens": [2],
                                                  "n_examples": [1], "loss": [2.0]})(folder)

    return setup


def checkpoint(obj_fn: Callable[[Path], Any] | None = None, raw: bytes | None = None) -> Callable[[Path], None]:
    rel = f"{CELL}/lr~0.001/checkpoint/state.pt"
    return write(rel, raw) if raw is not None else torch_save(rel, obj_fn)


def load_checkpoint_job() -> Callable[[Path], Outcome]:
    """userdp.training.checkpoint.load_checkpoint, how a finetune job resumes."""

    def fn(folder: Path) -> Any:
        from userdp.training import checkpoint as ckpt

        return ckpt.load_checkpoint(f"{CELL}/lr~0.001/checkpoint", "fingerprint-of-this-run")

    return job(fn)


class _OpensAFile:
    """An object whose unpickling would run code (opens a file): what a checkpoint must never hold."""

    def __reduce__(self):
        return (open, ("code_ran", "w"))


# ---------------------------------------------------------------- the table

LONG_GROUP = {"privacy": {"group_size": {"uls": 32}}, "training": {"physical_batch_size": 16}}

CASES: list[Case] = [
    # ============================================================ config
    config_case("top-level-key-typo", "a misspelt top-level section (`trainng:`)",
                "trainng: {optimizer: adam}\n", "unknown config key(s) ['trainng'] at the top level"),
    config_case("section-key-typo", "a misspelt key inside a section (`privacy.clip_nrom`)",
                "privacy: {clip_nrom: 1.0}\n", "unknown config key(s) ['clip_nrom'] under 'privacy'"),
    config_case("nested-key-typo", "a misspelt key two levels down (`privacy.group_size.ulss`)",
                "privacy: {group_size: {ulss: 4}}\n", "under 'privacy.group_size'"),
    config_case("budget-key-typo", "a grid budget written with `step:` instead of `steps:`",
                "grid: {budgets: [{compute: 800, step: 10}]}\n", "grid.budgets.0"),
    config_case("dataset-source-unknown", "a dataset with a source that does not exist (`source: reddit`)",
                "datasets:\n  x: {source: reddit}\n", "config key 'datasets.x.source' is 'reddit'"),
    config_case("dataset-source-missing", "a dataset without `source:`",
                "datasets:\n  x: {path: posts.csv}\n", "config key 'datasets.x' misses required key(s)"),
    config_case("dataset-key-of-other-source", "a key of another source on a dataset (`hub_name` on fortunes)",
                "datasets:\n  f: {source: fortunes, hub_name: x/y}\n", "datasets.f.hub_name: not a key of source 'fortunes'"),
    config_case("dataset-name-with-space", "a dataset name with a space (it becomes a path component)",
                "datasets:\n  my data: {source: synthetic}\n", "datasets"),
    config_case("datasets-empty", "an empty `datasets:` mapping",
                "datasets: {}\n", "config key 'datasets' is invalid"),
    config_case("datasets-missing", "a config without any `datasets:` (only overrides of other sections)",
                "grid: {epsilons: [1]}\n", "config.yaml: config key '(top level)' misses required key(s): 'datasets'",
                raw=True),
    config_case("dataset-spec-null", "a dataset name with nothing under it (`mine:` alone)",
                "datasets:\n  mine:\n", "config key 'datasets.mine' is invalid"),
    config_case("section-null", "a section header whose keys are all commented out (`privacy:` alone)",
                "privacy:\n#  delta: 1.0e-6\n", "config key 'privacy' is invalid"),
    config_case("section-as-list", "a section written as a YAML list (`training: [adam]`)",
                "training: [adam]\n", "config key 'training' is invalid"),
    config_case("yaml-syntax-error", "a config file that is not valid YAML (an unclosed bracket)",
                "grid: {epsilons: [1, 8}\n", "config.yaml is not valid YAML"),
    config_case("yaml-tab-indent", "a config indented with a tab character",
                "training:\n\toptimizer: adam\n", "config.yaml is not valid YAML"),
    config_case("yaml-not-a-mapping", "a config file that holds a list, not keys",
                "- datasets\n- synth\n", "config file config.yaml must hold a mapping of keys", raw=True),
    config_case("config-file-empty", "an empty config file",
                "", "config.yaml: config key '(top level)' misses required key(s): 'datasets'", raw=True),
    config_case("config-not-utf8", "a config file saved in Latin-1 (an accented comment)",
                "", "config file config.yaml is not UTF-8 text", raw=True,
                setup=write("config.yaml", "# r\xe9sum\xe9 of my study\ndatasets:\n  synth: {source: synthetic}\n".encode("latin-1"))),
    Case("config-file-missing", "config", "a --configfile path that does not exist (a typo in the file name)",
         job(lambda folder: __import__("userdp.config", fromlist=["x"]).load_config("confg.yaml")), 2,
         "config file confg.yaml does not exist", setup=write("config.yaml", MINIMAL_YAML), kept=("config.yaml",)),
    config_case("yaml-duplicate-section", "the same section written twice in one file (`grid:` at the top and again below)",
                "grid: {epsilons: [1]}\ntraining: {optimizer: sgd}\ngrid: {seeds: [0, 1]}\n", "grid"),
    config_case("yaml-exponent-without-dot", "`delta: 1e-6` (YAML 1.1 reads exponent notation without a dot as text)",
                "privacy: {delta: 1e-6}\n", "'privacy.delta' is the string '1e-6'"),
    config_case("yaml-exponent-without-sign", "`max_noise_multiplier: 1e3` (YAML 1.1 needs a dot and a sign: 1.0e+3)",
                "privacy: {max_noise_multiplier: 1e3}\n", "'privacy.max_noise_multiplier' is the string '1e3'",
                unwanted=("e.g. 1.0e3.",)),
    config_case("yaml-inf-unquoted", "`epsilons: [1, inf]` (YAML reads `inf` as a string)",
                "grid: {epsilons: [1, inf]}\n", "config key 'grid.epsilons.1' is the string 'inf'"),
    config_case("yaml-yes-as-number", "`clip_norm: on` (YAML 1.1 reads on/off/yes/no as booleans)",
                "privacy: {clip_norm: on}\n", "config key 'privacy.clip_norm' is invalid: True is not of type 'number'"),
    config_case("integer-as-quoted-string", "a count written in quotes (`physical_batch_size: \"64\"`)",
                "training: {physical_batch_size: \"64\"}\n", "config key 'training.physical_batch_size' is the string '64'",
                unwanted=("exponent notation",)),
    config_case("fraction-for-integer", "a fractional seed (`grid.seeds: [0.5]`)",
                "grid: {seeds: [0.5]}\n", "config key 'grid.seeds.0' is invalid"),
    config_case("seed-negative", "a negative root seed",
                "seed: -1\n", "config key 'seed' is invalid"),
    config_case("correlated-noise-one-band", "banded DP-FTRL with one band (`privacy.correlated_noise.bands: 1`)",
                "privacy: {correlated_noise: {bands: 1}}\n", "privacy.correlated_noise.bands"),
    config_case("option-invalid-value", "an option whose merged config is invalid (`grid.options.x` with quantile 2)",
                "grid: {options: {x: {privacy: {clipping: adaptive, adaptive: {quantile: 2}}}}}\n",
                "grid.options.x (its keys merged over the config's): config key 'privacy.adaptive.quantile'"),
    config_case("option-changes-nothing", "an option that sets only what the config already sets",
                "grid: {options: {same: {training: {optimizer: adam}}}}\n",
                "grid.options.same changes nothing in its ELS/ULS cells"),
    config_case("option-ftrl-with-els", "a DP-FTRL option that would run ELS cells (which stay DP-SGD)",
                "grid: {options: {ftrl: {privacy: {correlated_noise: {bands: 4}}}}}\n",
                "run it with `methods: ['uls']` only"),
    config_case("adaptive-key-typo", "a misspelt key of adaptive clipping (`privacy.adaptive.quantil`)",
                "privacy: {clipping: adaptive, adaptive: {quantil: 0.5}}\n",
                "unknown config key(s) ['quantil'] under 'privacy.adaptive'"),
    config_case("clip-norm-negative", "a negative clipping norm",
                "privacy: {clip_norm: -1}\n", "config key 'privacy.clip_norm' is invalid"),
    config_case("learning-rate-zero", "a learning rate of 0",
                "training: {learning_rates: [0.001, 0]}\n", "config key 'training.learning_rates.1' is invalid"),
    config_case("delta-above-one", "`privacy.delta: 1.5` (a probability above 1)",
                "privacy: {delta: 1.5}\n", "config key 'privacy.delta' is invalid"),
    config_case("split-fraction-negative", "a negative validation fraction",
                "datasets:\n  synth: {source: synthetic, split: {validation: -0.1}}\n",
                "config key 'datasets.synth.split.validation' is invalid"),
    config_case("split-fraction-one", "`split.test: 1` (every user a test user)",
                "datasets:\n  synth: {source: synthetic, split: {test: 1}}\n", "config key 'datasets.synth.split.test' is invalid"),
    config_case("split-leaves-no-train", "validation + test fractions that add up to 1 or more",
                "datasets:\n  synth: {source: synthetic, split: {validation: 0.6, test: 0.5}}\n",
                "datasets.synth.split: validation + test = 1.1 leaves no train users"),
    config_case("optimizer-typo", "an optimizer that does not exist (`rmsprop`)",
                "training: {optimizer: rmsprop}\n", "config key 'training.optimizer' is 'rmsprop'; allowed values"),
    config_case("long-examples-typo", "`tokenizer.long_examples: chunks` (plural)",
                "tokenizer: {long_examples: chunks}\n", "config key 'tokenizer.long_examples' is 'chunks'"),
    config_case("architecture-typo", "`model.architecture: llama2`",
                "model: {architecture: llama2}\n", "config key 'model.architecture' is 'llama2'"),
    config_case("accounting-typo", "`privacy.selection.accounting: composite`",
                "privacy: {selection: {accounting: composite}}\n", "'privacy.selection.accounting' is 'composite'"),
    config_case("method-typo", "a misspelt method in `grid.methods`",
                "grid: {methods: [els, ulss]}\n", "config key 'grid.methods.1' is 'ulss'"),
    config_case("method-twice", "the same method twice in `grid.methods`",
                "grid: {methods: [els, els]}\n", "config key 'grid.methods' is invalid"),
    config_case("epsilons-empty", "an empty list of epsilons",
                "grid: {epsilons: []}\n", "config key 'grid.epsilons' is invalid"),
    config_case("learning-rates-empty", "an empty list of learning rates",
                "training: {learning_rates: []}\n", "config key 'training.learning_rates' is invalid"),
    config_case("epsilon-twice", "the same epsilon twice, written differently (`[1, 1.0]`)",
                "grid: {epsilons: [1, 1.0]}\n", "grid.epsilons lists the same number twice"),
    config_case("learning-rate-twice", "the same learning rate twice (`0.001` and `1.0e-3`)",
                "training: {learning_rates: [0.001, 1.0e-3]}\n", "training.learning_rates lists the same number twice"),
    config_case("budget-compute-twice", "two grid budgets with the same compute",
                "grid: {budgets: [{compute: 800, steps: 10}, {compute: 800, steps: 20}]}\n",
                "grid.budgets has two entries with compute 800"),
    config_case("budget-below-one-per-step", "a budget with fewer examples than steps (compute < steps)",
                "grid: {budgets: [{compute: 30, steps: 50}]}\n", "grid.budgets has {compute: 30, steps: 50}"),
    config_case("mean-estimation-budget", "a mean-estimation budget with compute < steps",
                "mean_estimation: {budgets: [{compute: 5, steps: 10}]}\n", "mean_estimation.budgets has {compute: 5, steps: 10}"),
    config_case("nan-number", "`clip_norm: .nan`",
                "privacy: {clip_norm: .nan}\n", "config key 'privacy.clip_norm' is NaN"),
    config_case("inf-delta", "`delta: .inf`",
                "privacy: {delta: .inf}\n", "config key 'privacy.delta' is infinite"),
    config_case("minus-inf-learning-rate", "a learning rate of `-.inf`",
                "training: {learning_rates: [-.inf]}\n", "config key 'training.learning_rates.0' is -infinite"),
    config_case("inf-epsilon", "`.inf` in grid.epsilons (meant as the non-private reference)",
                "grid: {epsilons: [1, .inf]}\n", "config key 'grid.epsilons.1' is infinite"),
    config_case("huge-epsilon", "an epsilon of 1e16 (`1.0e+16`)",
                "grid: {epsilons: [1, 1.0e+16]}\n", "grid.epsilons has 1e16; epsilons of 1e15 and above are not supported"),
    config_case("grid-dataset-unknown", "`grid.datasets` names a dataset that is not defined",
                "grid: {datasets: [synthetic]}\n", "grid.datasets names unknown dataset(s) ['synthetic']"),
    config_case("audit-dataset-unknown", "`audit.datasets` names a dataset that is not defined",
                "audit: {datasets: [so]}\n", "audit.datasets names unknown dataset(s) ['so']"),
    config_case("public-dataset-unknown", "`tokenizer.public_dataset` names a dataset that is not defined",
                "tokenizer: {public_dataset: fortunes}\n", "tokenizer.public_dataset is 'fortunes', which is not a dataset"),
    config_case("public-dataset-without-public-part", "`tokenizer.public_dataset` is a dataset with no public text",
                "datasets:\n  synth: {source: synthetic}\n  so: {source: stackoverflow, path: so.sqlite}\n"
                "tokenizer: {public_dataset: so}\n", "tokenizer.public_dataset is 'so'",
                setup=so_sqlite("so.sqlite"), kept=("so.sqlite",)),
    config_case("els-snr", "`privacy.group_size.els: snr` (a ULS-only rule)",
                "privacy: {group_size: {els: snr}}\n", "privacy.group_size.els is 'snr', a rule for ULS only"),
    config_case("group-size-zero", "`privacy.group_size.els: 0`",
                "privacy: {group_size: {els: 0}}\n", "config key 'privacy.group_size.els' is 0"),
    config_case("uls-group-over-batch", "an explicit ULS G larger than the micro-batch",
                "privacy: {group_size: {uls: 32}}\ntraining: {physical_batch_size: 16}\n",
                "training.physical_batch_size is 16 but ULS needs whole users in one micro-batch"),
    config_case("sweep-group-over-batch", "a G in grid.group_size_sweep larger than the micro-batch",
                "grid: {group_size_sweep: [1, 64]}\ntraining: {physical_batch_size: 16}\n", "grid.group_size_sweep"),
    config_case("stats-epsilon-too-large", "DP contribution statistics with an epsilon as large as a grid epsilon",
                "privacy: {contribution_stats: {private: true, epsilon: 1}}\ngrid: {epsilons: [1, 8]}\n",
                "privacy.contribution_stats.epsilon = 1 is >= the smallest grid epsilon 1"),
    config_case("group-sweep-epsilon-not-listed", "mean_estimation.group_sweep_epsilon not among its epsilons",
                "mean_estimation: {epsilons: [1, 4], group_sweep_epsilon: 2}\n",
                "mean_estimation.group_sweep_epsilon is 2, which is not one of mean_estimation.epsilons"),
    config_case("secret-longer-than-sequence", "an audit secret that does not fit the sequence length",
                "tokenizer: {sequence_length: 16}\naudit: {secret_length: 15}\n",
                "audit.secret_length is 15, but a canary example is bos + prefix + secret + eos"),
    config_case("prefix-longer-than-sequence", "an audit prefix that leaves no room for a secret",
                "tokenizer: {sequence_length: 16}\naudit: {prefix_length: 14}\n",
                "audit.prefix_length is 14, but a canary example is bos + prefix + secret + eos"),
    config_case("unknown-canary-design", "a canary design the audit does not know",
                "audit: {canary_design: newtoken}\n", "audit.canary_design"),
    config_case("audit-budget-without-steps", "an audit budget without `steps`",
                "audit: {budget: {compute: 400}}\n", "config key 'audit.budget' misses required key(s)"),
    config_case("heads-do-not-divide-width", "model.n_embd not divisible by model.n_head",
                "model: {n_embd: 30, n_head: 4}\n", "model.n_embd (30) must be divisible by model.n_head (4)"),
    config_case("hub-model-without-tokenizer", "`model.name: gpt2-medium` with `tokenizer.name` left null",
                "model: {name: gpt2-medium}\n", "model.name is set, so set tokenizer.name"),
    config_case("lora-dropout-one", "`model.lora.dropout: 1`",
                "model: {lora: {dropout: 1}}\n", "config key 'model.lora.dropout' is invalid"),
    config_case("lora-key-typo", "a misspelt LoRA key (`model.lora.rank`)",
                "model: {lora: {rank: 8}}\n", "unknown config key(s) ['rank'] under 'model.lora'"),
    config_case("vocab-too-small", "`tokenizer.vocab_size: 100` (below the 256 bytes + specials)",
                "tokenizer: {vocab_size: 100}\n", "config key 'tokenizer.vocab_size' is invalid"),
    config_case("local-dataset-without-path", "a local dataset without `path:`",
                "datasets:\n  mine: {source: local}\n", "datasets.mine.path is required for source 'local'"),
    config_case("local-dataset-path-missing", "a local dataset whose file does not exist (a typo in the path)",
                "datasets:\n  mine: {source: local, path: data/post.csv}\n",
                "datasets.mine.path is data/post.csv, which does not exist",
                setup=local_file("data/posts.csv", "csv"), kept=("data/posts.csv",)),
    config_case("local-dataset-path-is-folder", "a local dataset whose path is a folder of CSV files (a folder must hold "
                "Parquet files or be written by datasets' save_to_disk)",
                "datasets:\n  mine: {source: local, path: data}\n",
                "data (datasets.mine.path) is a folder without .parquet files",
                setup=local_file("data/posts.csv", "csv"), kept=("data/posts.csv",)),
    config_case("local-column-key-typo", "`user_colum:` on a local dataset",
                "datasets:\n  mine: {source: local, path: posts.csv, user_colum: author}\n",
                "datasets.mine.user_colum: not a key of source 'local'", setup=local_file("posts.csv", "csv"),
                kept=("posts.csv",)),
    config_case("local-format-unknown", "`format: xlsx` on a local dataset",
                "datasets:\n  mine: {source: local, path: posts.xlsx, format: xlsx}\n",
                "config key 'datasets.mine.format' is 'xlsx'", setup=write("posts.xlsx", b"PK\x03\x04"),
                kept=("posts.xlsx",)),
    config_case("public-corpus-key-typo", "a misspelt key of a dataset's public corpus (`public: {pth: ...}`)",
                "datasets:\n  synth: {source: synthetic, public: {pth: c4.parquet}}\n",
                "datasets.synth.public.pth: not a key of a public corpus"),
    config_case("public-corpus-path-and-hub", "a public corpus with both a path and a hub name",
                "datasets:\n  synth: {source: synthetic, public: {path: c4.parquet, hub_name: allenai/c4}}\n",
                "datasets.synth.public has both of"),
    config_case("synthetic-key-typo", "a misspelt generator key (`synthetic: {n_user: 10}`)",
                "datasets:\n  synth: {source: synthetic, synthetic: {n_user: 10}}\n",
                "unknown config key(s) ['n_user'] under 'datasets.synth.synthetic'"),
    config_case("stackoverflow-split-typo", "a Stack Overflow split that does not exist (`validation`)",
                "datasets:\n  so: {source: stackoverflow, splits: [train, validation]}\n",
                "config key 'datasets.so.splits.1' is 'validation'"),
    config_case("max-examples-zero", "`max_examples: 0` on a dataset",
                "datasets:\n  synth: {source: synthetic, max_examples: 0}\n", "config key 'datasets.synth.max_examples' is invalid"),
    config_case("findings-name-with-slash", "a study name with a slash (it is a file name)",
                "findings: {name: my/study}\n", "config key 'findings.name' is invalid"),
    config_case("mean-runs-below-one", "`privacy.selection.mean_runs: 0.5`",
                "privacy: {selection: {accounting: random_stopping, mean_runs: 0.5}}\n",
                "config key 'privacy.selection.mean_runs' is invalid"),
    snakemake_case("snakemake-local-path-missing", "snakemake with a local dataset whose file is not there",
                   "datasets:\n  mine: {source: local, path: data/posts.csv}\ngrid: {datasets: [mine]}\n",
                   "datasets.mine.path is data/posts.csv, which does not exist", absent=("results", "data")),
    Case("snakemake-target-after-configfile", "config",
         "a target written after --configfile (snakemake reads it as a second config file)",
         snakemake("--configfile", str(REPO / "config" / "config.yaml"),
                   "results/runs/synth/method~els/eps~8/budget~8000/seed~0/metrics.json"),
         1, "which look like targets (pipeline artifacts), not config files",
         setup=write("results/runs/synth/method~els/eps~8/budget~8000/seed~0/metrics.json", '{"test_loss": 4.1}\n'),
         kept=("results/runs/synth/method~els/eps~8/budget~8000/seed~0/metrics.json",)),

    # ============================================================ data
    Case("group-column-varies", "data", "`group_column: region` on a file where one user's rows carry two regions",
         labels_job(local("posts.jsonl", group_column="region")), 2,
         "user 'b' has rows with different labels ['east', 'south'] in group column 'region'",
         setup=local_file("posts.jsonl", "jsonl", [{"user_id": "a", "text": "x", "region": "north"},
                                                   {"user_id": "b", "text": "y", "region": "south"},
                                                   {"user_id": "b", "text": "z", "region": "east"}]),
         absent=("results/data/mine/user_labels.parquet",), kept=("posts.jsonl",)),
    Case("group-column-missing", "data", "`group_column: region` on a file without that column",
         labels_job(local("posts.csv", group_column="region")), 2, "missing column(s) ['region']",
         setup=local_file("posts.csv", "csv"), absent=("results/data/mine/user_labels.parquet",),
         kept=("posts.csv",)),
    data_case("csv-missing-text-column", "a CSV whose text column is called `body`", local("posts.csv"),
              local_file("posts.csv", "csv", rename={"text": "body"}), "missing column(s) ['text']", kept=("posts.csv",)),
    data_case("parquet-missing-user-column", "a Parquet file whose user column is called `author`",
              local("posts.parquet"), local_file("posts.parquet", "parquet", rename={"user_id": "author"}),
              "missing column(s) ['user_id']; the file has columns ['author', 'text']", kept=("posts.parquet",)),
    data_case("user-column-setting-wrong", "`user_column: author` on a file whose column is `user`",
              local("posts.jsonl", user_column="author"), local_file("posts.jsonl", "jsonl", rename={"user_id": "user"}),
              "missing column(s) ['author']", kept=("posts.jsonl",)),
    data_case("file-empty", "an empty (0-byte) data file", local("posts.csv"), write("posts.csv", b""),
              "posts.csv (datasets.mine, format csv): the file is empty (0 bytes)", kept=("posts.csv",)),
    data_case("csv-header-only", "a CSV with a header and no rows", local("posts.csv"),
              write("posts.csv", "user_id,text\n"), "the file has no data rows", kept=("posts.csv",)),
    data_case("jsonl-truncated-line", "a JSON Lines file whose last line was cut off", local("posts.jsonl"),
              steps(local_file("posts.jsonl", "jsonl"), truncate("posts.jsonl", 0.9)), "line 6 is not valid JSON",
              kept=("posts.jsonl",)),
    data_case("jsonl-array-line", "a JSON Lines file with a line that is a list, not an object", local("posts.jsonl"),
              write("posts.jsonl", '{"user_id": "a", "text": "x"}\n["b", "y"]\n'), "line 2 holds a JSON list",
              kept=("posts.jsonl",)),
    data_case("jsonl-mixed-id-types", "user ids that are integers on some lines and strings on others",
              local("posts.jsonl"), write("posts.jsonl", '{"user_id": 7, "text": "x"}\n{"user_id": "7", "text": "y"}\n'),
              "line 2: 'user_id' is a string ('7'), but line 1's is an integer", kept=("posts.jsonl",)),
    data_case("jsonl-null-user", "a JSON Lines row with `\"user_id\": null`", local("posts.jsonl"),
              write("posts.jsonl", '{"user_id": "a", "text": "x"}\n{"user_id": null, "text": "y"}\n'),
              "line 2 has a null user id in column 'user_id'", kept=("posts.jsonl",)),
    data_case("jsonl-float-user", "a JSON Lines user id that is a number with a fraction", local("posts.jsonl"),
              write("posts.jsonl", '{"user_id": 1.5, "text": "x"}\n'), "line 1, column 'user_id' holds double values (1.5); user ids must be strings",
              kept=("posts.jsonl",)),
    data_case("jsonl-text-number", "a JSON Lines text that is a number", local("posts.jsonl"),
              write("posts.jsonl", '{"user_id": "a", "text": 42}\n'), "line 1, column 'text' holds int64 values (42), not text",
              kept=("posts.jsonl",)),
    data_case("jsonl-not-utf8", "a JSON Lines file in Latin-1", local("posts.jsonl"),
              write("posts.jsonl", '{"user_id": "a", "text": "ok"}\n{"user_id": "b", "text": "caf\xe9"}\n'.encode("latin-1")),
              "line 2 (byte offset", kept=("posts.jsonl",)),
    data_case("parquet-null-user", "a Parquet row with a null user id", local("posts.parquet"),
              parquet("posts.parquet", {"user_id": ["a", None, "b"], "text": ["x", "y", "z"]}),
              "row 2 has a null user id in column 'user_id'", kept=("posts.parquet",)),
    data_case("csv-empty-user", "a CSV row with an empty user id", local("posts.csv"),
              write("posts.csv", "user_id,text\nalice,hi\n,orphan\n"), "has a empty user id", kept=("posts.csv",)),
    data_case("parquet-float-user-column", "a Parquet user column of floats (ids read as 1.0, 2.0)",
              local("posts.parquet"), parquet("posts.parquet", {"user_id": [1.0, 2.0], "text": ["x", "y"]}),
              "row 1, column 'user_id' holds double values (1.0); user ids must be strings or integers", kept=("posts.parquet",)),
    data_case("parquet-text-column-integers", "a Parquet text column of integers", local("posts.parquet"),
              parquet("posts.parquet", {"user_id": ["a", "b"], "text": [1, 2]}), "row 1, column 'text' holds int64 values (1), not text",
              kept=("posts.parquet",)),
    data_case("parquet-truncated", "a Parquet data file cut off halfway (an interrupted copy)", local("posts.parquet"),
              steps(local_file("posts.parquet", "parquet"), truncate("posts.parquet")), "not a valid Parquet file",
              kept=("posts.parquet",)),
    data_case("parquet-named-csv", "a Parquet file with a .csv name", local("posts.csv"),
              local_file("posts.csv", "parquet"), "this is a Parquet file, not csv; set datasets.mine.format: parquet",
              kept=("posts.csv",)),
    data_case("unknown-extension", "a data file with an extension the loader does not know (.txt)",
              local("posts.txt"), write("posts.txt", "alice\thello\n"), "datasets.mine.format is auto but the extension",
              kept=("posts.txt",)),
    data_case("csv-wrong-separator", "`separator: ','` on a file separated by `;`", local("posts.csv", separator=","),
              local_file("posts.csv", "csv", separator=";"),
              "looks separated by ';': set datasets.mine.separator: \";\"", kept=("posts.csv",)),
    data_case("gzip-truncated", "a .jsonl.gz data file cut off halfway (an interrupted download)",
              local("posts.jsonl.gz"), steps(local_file("posts.jsonl.gz", "jsonl", compression="gzip"),
                                              truncate("posts.jsonl.gz")),
              "posts.jsonl.gz (datasets.mine, format jsonl): the gzip stream is damaged", kept=("posts.jsonl.gz",)),
    data_case("parquet-gzipped", "a Parquet file compressed again with gzip (`.parquet.gz`)", local("posts.parquet.gz"),
              steps(local_file("posts.parquet", "parquet"), gzip_file("posts.parquet")),
              "Parquet compresses its own columns, so decompress the file", kept=("posts.parquet.gz",)),
    data_case("save-to-disk-dataset-dict", "a `DatasetDict.save_to_disk` folder (splits) as a dataset's path",
              local("saved"), saved_dataset_dict("saved"), "this is a DatasetDict with splits ['train', 'test']",
              kept=("saved/dataset_dict.json",)),
    data_case("save-to-disk-not-a-folder", "`format: save_to_disk` on a CSV file", local("posts.csv", format="save_to_disk"),
              local_file("posts.csv", "csv"), "format save_to_disk reads the folder that datasets.Dataset.save_to_disk "
              "wrote", kept=("posts.csv",)),
    data_case("csv-not-utf8", "a CSV file in Latin-1", local("posts.csv"),
              write("posts.csv", "user_id,text\nalice,ok\nbob,caf\xe9\n".encode("latin-1")),
              "line 3 (byte offset", kept=("posts.csv",)),
    data_case("csv-ragged-row", "a CSV row with more fields than the header", local("posts.csv"),
              write("posts.csv", "user_id,text\nalice,hi\nbob,a,b,c\n"), "not a valid CSV file", kept=("posts.csv",)),
    data_case("all-texts-empty", "a data file whose every text is empty", local("posts.csv"),
              write("posts.csv", 'user_id,text\nalice,""\nbob,"  "\n'), "dataset mine: no users left after filtering",
              kept=("posts.csv",)),
    data_case("min-examples-too-high", "`min_examples_per_user` above every user's count",
              local("posts.csv", min_examples_per_user=50), local_file("posts.csv", "csv"),
              "Lower datasets.mine.min_examples_per_user", kept=("posts.csv",)),
    data_case("fortune-file-no-authors", "a fortune file with no attributed quotes", {"source": "fortunes", "path": "quotes"},
              fortune_file("quotes", [("A quote nobody said.", None), ("Another one.", None)]),
              "datasets.mine: the fortune files hold no attributed quotes", kept=("quotes",)),
    data_case("fortune-folder-empty", "a fortune folder with no files", {"source": "fortunes", "path": "fortunes"},
              write("fortunes/.keep", ""), "fortunes holds no fortune files", kept=("fortunes/.keep",)),
    data_case("fortune-path-missing", "a fortunes dataset whose path does not exist",
              {"source": "fortunes", "path": "my-fortunes"}, fortune_file("fortunes/quotes", [("Hi.", "Me")]),
              "my-fortunes does not exist; fix datasets.<name>.path", kept=("fortunes/quotes",)),
    data_case("fortune-not-utf8", "a fortune file in Latin-1", {"source": "fortunes", "path": "quotes"},
              write("quotes", "Caf\xe9 au lait.\n\t\t-- Someone\n%\n".encode("latin-1")), "quotes: line 1 (byte offset",
              kept=("quotes",)),
    data_case("sqlite-not-a-database", "a Stack Overflow path that is not a SQLite file (an HTML error page)",
              {"source": "stackoverflow", "path": "so.sqlite"}, write("so.sqlite", "<html>Not Found</html>\n"),
              "so.sqlite is not a readable SQLite database", kept=("so.sqlite",)),
    data_case("sqlite-without-metadata", "a Stack Overflow SQLite without its client_metadata table",
              {"source": "stackoverflow", "path": "so.sqlite"}, so_sqlite("so.sqlite", with_metadata=False),
              "so.sqlite has no table 'client_metadata'", kept=("so.sqlite",)),
    data_case("sqlite-corrupt-example", "a Stack Overflow row whose blob is not a tf.train.Example",
              {"source": "stackoverflow", "path": "so.sqlite"},
              so_sqlite("so.sqlite", rows=[("train", "00000001", "fine ."), ("train", "00000002", b"\xff\xfe garbage")]),
              "so.sqlite: examples rowid 2 holds no valid tf.train.Example", kept=("so.sqlite",)),
    data_case("stackoverflow-user-in-two-splits", "a Stack Overflow file where one user is in train and heldout",
              {"source": "stackoverflow", "path": "so.sqlite"},
              so_sqlite("so.sqlite", rows=[("train", "00000001", "a ."), ("heldout", "00000001", "b ."),
                                           ("train", "00000002", "c .")]),
              "the source's split is not user-disjoint; set datasets.mine.split.use_source_split: false",
              kept=("so.sqlite",)),
    data_case("lzma-truncated", "a downloaded stackoverflow.sqlite.lzma cut off halfway",
              {"source": "stackoverflow", "path": "stackoverflow.sqlite.lzma"},
              so_lzma("stackoverflow.sqlite.lzma", cut=0.5), "stackoverflow.sqlite.lzma",
              kept=("stackoverflow.sqlite.lzma",), absent=("data/mine/stackoverflow.sqlite",)),
    data_case("lzma-sha256-mismatch", "a local .lzma whose SHA-256 is not the one in the config",
              {"source": "stackoverflow", "path": "stackoverflow.sqlite.lzma", "sha256": "0" * 64},
              so_lzma("stackoverflow.sqlite.lzma"), "SHA-256 does not match datasets.mine.sha256",
              kept=("stackoverflow.sqlite.lzma",), absent=("data/mine/stackoverflow.sqlite",)),
    data_case("cc-news-missing-domain", "a CC-News Parquet without the `domain` column", {"source": "cc_news", "path": "news.parquet"},
              cc_news_parquet("news.parquet", columns=("title", "text", "date", "url")), "domain", kept=("news.parquet",)),
    data_case("cc-news-folder-without-parquet", "a CC-News folder with no Parquet files",
              {"source": "cc_news", "path": "news"}, write("news/README.txt", "downloaded later\n"), "news",
              kept=("news/README.txt",)),
    data_case("public-txt-empty", "a public corpus .txt file with only blank lines",
              {"source": "synthetic", "public": {"path": "c4.txt"}}, write("c4.txt", "\n\n   \n"),
              "has no non-empty text", name="synth", public=True, kept=("c4.txt",)),
    data_case("public-jsonl-missing-text", "a public corpus JSON Lines file without a `text` key",
              {"source": "synthetic", "public": {"path": "c4.jsonl"}}, write("c4.jsonl", '{"content": "hello"}\n'),
              "c4.jsonl", name="synth", public=True, kept=("c4.jsonl",)),
    data_case("public-path-missing", "a public corpus path that does not exist",
              {"source": "synthetic", "public": {"path": "c4.parquet"}}, None, "c4.parquet (datasets.synth.public.path) does not exist",
              name="synth", public=True),

    # ============================================================ cli
    Case("cli-epsilon-negative", "cli", "`calibrate --epsilon -1`",
         cli("calibrate --method els --epsilon -1 --delta 1e-6 --sampling-rate 0.01 --steps 10"),
         2, "argument --epsilon: epsilon must be a number > 0 (or inf), got '-1'"),
    Case("cli-epsilon-zero", "cli", "`calibrate --epsilon 0`",
         cli("calibrate --method els --epsilon 0 --delta 1e-6 --sampling-rate 0.01 --steps 10"),
         2, "argument --epsilon: epsilon must be a number > 0"),
    Case("cli-epsilon-not-a-number", "cli", "`calibrate --epsilon four`",
         cli("calibrate --method els --epsilon four --delta 1e-6 --sampling-rate 0.01 --steps 10"),
         2, "argument --epsilon: epsilon must be a number, got 'four'"),
    Case("cli-delta-one", "cli", "`--delta 1`",
         cli("calibrate --method els --epsilon 4 --delta 1 --sampling-rate 0.01 --steps 10"),
         2, "argument --delta: delta must be in (0, 1)"),
    Case("cli-delta-typo", "cli", "`--delta 1e-6x` (a stray character)",
         cli("calibrate --method els --epsilon 4 --delta 1e-6x --sampling-rate 0.01 --steps 10"),
         2, "argument --delta: delta must be a number in (0, 1), got '1e-6x'"),
    Case("cli-rate-above-one", "cli", "`--sampling-rate 1.5`",
         cli("calibrate --method els --epsilon 4 --delta 1e-6 --sampling-rate 1.5 --steps 10"),
         2, "argument --sampling-rate: sampling rate must be in (0, 1]"),
    Case("cli-rate-percent", "cli", "`--sampling-rate 1%` (a percentage)",
         cli("calibrate --method els --epsilon 4 --delta 1e-6 --sampling-rate 1% --steps 10"),
         2, "argument --sampling-rate: sampling rate must be a number in (0, 1], got '1%'"),
    Case("cli-steps-zero", "cli", "`--steps 0`",
         cli("epsilon --method els --noise-multiplier 1 --delta 1e-6 --sampling-rate 0.01 --steps 0"),
         2, "argument --steps: steps must be a whole number >= 1, got '0'"),
    Case("cli-steps-fraction", "cli", "`--steps 2.5`",
         cli("epsilon --method els --noise-multiplier 1 --delta 1e-6 --sampling-rate 0.01 --steps 2.5"),
         2, "argument --steps: steps must be a whole number >= 1, got '2.5'"),
    Case("cli-group-size-zero", "cli", "`--group-size 0`",
         cli("epsilon --method els --noise-multiplier 1 --delta 1e-6 --sampling-rate 0.01 --steps 10 --group-size 0"),
         2, "argument --group-size: group size must be a whole number >= 1"),
    Case("cli-group-size-with-uls", "cli", "`--group-size 8` with `--method uls` (it has no effect)",
         cli("epsilon --method uls --noise-multiplier 1 --delta 1e-6 --sampling-rate 0.01 --steps 10 --group-size 8"),
         2, "--group-size 8 has no effect with --method uls"),
    Case("cli-method-unknown", "cli", "`--method dpsgd`",
         cli("epsilon --method dpsgd --noise-multiplier 1 --delta 1e-6 --sampling-rate 0.01 --steps 10"),
         2, "argument --method: invalid choice: 'dpsgd'"),
    Case("cli-delta-missing", "cli", "`calibrate` without `--delta`",
         cli("calibrate --method els --epsilon 4 --sampling-rate 0.01 --steps 10"),
         2, "the following arguments are required: --delta"),
    Case("cli-no-command", "cli", "`python -m userdp` with no command", cli(), 2,
         "the following arguments are required: command"),
    Case("cli-command-typo", "cli", "`python -m userdp calibrat ...`",
         cli("calibrat --method els"), 2, "argument command: invalid choice: 'calibrat'"),
    Case("cli-noise-negative", "cli", "`--noise-multiplier -2`",
         cli("epsilon --method els --noise-multiplier -2 --delta 1e-6 --sampling-rate 0.01 --steps 10"),
         2, "argument --noise-multiplier: noise multiplier must be a finite number >= 0, got '-2'"),
    Case("cli-noise-nan", "cli", "`--noise-multiplier nan`",
         cli("epsilon --method els --noise-multiplier nan --delta 1e-6 --sampling-rate 0.01 --steps 10"),
         2, "argument --noise-multiplier: noise multiplier must be a finite number >= 0, got 'nan'"),
    Case("cli-calibration-infeasible", "cli", "a calibration target no noise up to --max-noise-multiplier meets",
         cli("calibrate --method els --epsilon 0.01 --delta 1e-6 --sampling-rate 1 --steps 10 --group-size 4 --max-noise-multiplier 5"),
         2, "no noise multiplier up to"),
    Case("cli-audit-mechanism-epsilon-not-audited", "cli", "`audit-mechanism --epsilon 3` when audit.epsilons is [2]",
         cli("audit-mechanism --configfile audit.yaml --epsilon 3"), 2,
         "epsilon 3 is not audited: the audit's epsilons (audit.epsilons", setup=write("audit.yaml", "audit: {epsilons: [2]}\n"),
         kept=("audit.yaml",)),
    Case("cli-audit-mechanism-method-not-audited", "cli", "`audit-mechanism --method els` when audit.methods is [uls]",
         cli("audit-mechanism --configfile audit.yaml --method els"), 2,
         "method 'els' is not audited: audit.methods is ['uls']", setup=write("audit.yaml", "audit: {methods: [uls]}\n"),
         kept=("audit.yaml",)),
    Case("cli-audit-mechanism-key-typo", "cli", "a misspelt `audit.mechanism` key (`canaris`)",
         cli("audit-mechanism --configfile audit.yaml"), 2, "canaris",
         setup=write("audit.yaml", "audit: {mechanism: {canaris: 10}}\n"), kept=("audit.yaml",)),
    Case("cli-vacuous-delta", "cli", "a delta above the chance that a user is ever sampled",
         cli("calibrate --method uls --epsilon 4 --delta 0.00133 --sampling-rate 0.00009 --steps 12"),
         2, "vacuous"),
    Case("cli-memory-bound", "cli", "`--stats-epsilon 10000` (a PLD too large to build)",
         cli("epsilon --method uls --noise-multiplier 1 --delta 1e-6 --sampling-rate 0.01 --steps 10 --stats-epsilon 10000"),
         2, "MAX_PLD_POINTS"),
    Case("cli-calibrate-huge-pld", "cli", "calibration at epsilon 1e-6, delta 1e-10, q = 1, 100,000 steps, G = 64 (it "
         "once grew to 23.5 GB and was killed by the kernel; later refused at the accountant's memory bound; ELS at "
         "q = 1 is now the Gaussian mechanism with sensitivity G, whose PLD is small: the target is infeasible)",
         cli("calibrate --method els --epsilon 1e-6 --delta 1e-10 --sampling-rate 1 --steps 100000 --group-size 64"),
         2, "no noise multiplier up to privacy.max_noise_multiplier = 500 reaches epsilon = 1e-06 at delta = 1e-10"),
    Case("cli-calibrate-tiny-epsilon", "cli", "calibration at epsilon 1e-6, q = 1, 1,000 steps, G = 64 (it once ended "
         "in MemoryError: std::bad_alloc under a 3 GB limit)",
         cli("calibrate --method els --epsilon 1e-6 --delta 1e-6 --sampling-rate 1 --steps 1000 --group-size 64"),
         2, "no noise multiplier up to privacy.max_noise_multiplier = 500 reaches epsilon = 1e-06"),
    Case("cli-stats-spend-the-budget", "cli", "`--stats-epsilon` larger than the target `--epsilon`",
         cli("calibrate --method uls --epsilon 0.2 --stats-epsilon 0.3 --delta 1e-6 --sampling-rate 0.02 --steps 50"),
         2, "no noise level leaves room for training"),
    Case("cli-runs-with-per-run", "cli", "`--runs 3` without `--selection` (per_run is one run's epsilon)",
         cli("epsilon --method uls --noise-multiplier 1.2 --delta 1e-6 --sampling-rate 0.02 --steps 100 --runs 3"),
         2, "--runs 3 with --selection per_run"),
    Case("cli-negative-shape", "cli", "`--selection random_stopping --shape -1`",
         cli("calibrate --method uls --epsilon 2 --delta 1e-6 --sampling-rate 0.02 --steps 100 --selection random_stopping --shape -1"),
         2, "shape"),
    Case("cli-selection-for-baseline", "cli", "`--selection composed` with a comparison-only method (`group`)",
         cli("epsilon --method group --noise-multiplier 2 --delta 1e-6 --sampling-rate 0.01 --steps 10 --group-size 2 --selection composed --runs 2"),
         2, "--selection composed / random_stopping is for the training methods els and uls"),
    Case("cli-tolerance-zero", "cli", "`--tolerance 0`",
         cli("calibrate --method els --epsilon 4 --delta 1e-6 --sampling-rate 0.01 --steps 10 --tolerance 0"),
         2, "argument --tolerance: tolerance must be a number > 0, got '0'"),
    Case("cli-check-config-typo", "cli", "`check-config my.yaml` of an override file with a misspelt section",
         cli("check-config my.yaml"), 2, "+ my.yaml: unknown config key(s) ['trainng'] at the top level",
         setup=write("my.yaml", "trainng: {optimizer: sgd}\n"), kept=("my.yaml",)),
    Case("cli-check-config-missing-file", "cli", "`check-config` of a file that does not exist",
         cli("check-config my.yml"), 2, "config file my.yml does not exist",
         setup=write("my.yaml", "training: {optimizer: sgd}\n"), kept=("my.yaml",)),
    Case("cli-run-target-after-configfile", "cli", "`run --configfile my.yaml TARGET`: snakemake would read the "
         "target as a second config file", cli("run -n --configfile my.yaml results/data/synth/contributions.json"), 2,
         "put the targets first, or end the option with '=' (--configfile=my.yaml "
         "results/data/synth/contributions.json)", setup=write("my.yaml", "training: {optimizer: sgd}\n"),
         kept=("my.yaml",)),
    Case("cli-run-missing-configfile", "cli", "`run --configfile=my.yml TARGET` of a file that does not exist",
         cli("run -n --configfile=my.yml results/data/synth/contributions.json"), 2,
         "userdp run: error: config file my.yml does not exist",
         setup=write("my.yaml", "training: {optimizer: sgd}\n"), kept=("my.yaml",)),
    Case("cli-run-yaml-syntax", "cli", "`run --configfile=my.yaml TARGET` of a file indented with a tab",
         cli("run -n --configfile=my.yaml results/data/synth/contributions.json"), 2,
         "config file my.yaml is not valid YAML at line 2, column 1",
         setup=write("my.yaml", "training:\n\toptimizer: sgd\n"), kept=("my.yaml",)),
    Case("cli-export-into-existing-folder", "cli", "`export-merged RUN/model merged/` where merged/ already holds files",
         cli("export-merged run/model merged"), 2, "merged exists; give a new folder (nothing is overwritten)",
         setup=steps(write("run/model/adapter_config.json", "{}"), write("merged/notes.txt", "my notes\n")),
         kept=("merged", "run/model")),

    # ============================================================ model
    config_case("model-folder-missing", "`model.name: ./my-llama` and the folder does not exist",
                "model: {name: ./my-llama}\ntokenizer: {name: ./my-llama}\n",
                "model.name is ./my-llama, a local path that does not exist", kind="model"),
    config_case("model-name-is-a-file", "`model.name` pointing at the weights file instead of its folder",
                "model: {name: ./my-model/model.safetensors}\ntokenizer: {name: ./my-model}\n",
                "model.name is ./my-model/model.safetensors, which is a file, not a folder",
                setup=tiny_model("my-model"), kept=("my-model",), kind="model"),
    config_case("model-folder-without-config", "`model.name` a folder without config.json (e.g. only weights)",
                "model: {name: ./weights}\ntokenizer: {name: ./weights}\n", "model.name is ./weights, a folder without config.json",
                setup=write("weights/pytorch_model.bin", b"\0" * 16), kept=("weights",), kind="model"),
    config_case("model-folder-without-weights-at-start", "`model.name` a folder with config.json but no weights "
                "(a copy that skipped the big files)", "model: {name: ./my-model}\ntokenizer: {name: ./my-model}\n",
                "model.name is ./my-model, a folder with config.json but no weights",
                setup=tiny_model("my-model", weights=False), kept=("my-model",), kind="model"),
    config_case("model-config-broken-at-start", "`model.name` a folder whose config.json is cut off",
                "model: {name: ./my-model}\ntokenizer: {name: ./my-model}\n", "model.name is ./my-model, whose",
                setup=steps(tiny_model("my-model"), truncate("my-model/config.json")), kept=("my-model",), kind="model"),
    config_case("tokenizer-name-is-a-file", "`tokenizer.name` pointing at tokenizer.json instead of its folder",
                "model: {name: ./my-model}\ntokenizer: {name: ./my-model/tokenizer.json}\n",
                "tokenizer.name is ./my-model/tokenizer.json, which is a file, not a folder",
                setup=steps(tiny_model("my-model"), write("my-model/tokenizer.json", "{}")), kept=("my-model",), kind="model"),
    config_case("model-with-own-tokenizer-but-bpe", "a local model that has its own tokenizer, with tokenizer.name null",
                "model: {name: ./my-model}\n", "model.name is set, so set tokenizer.name",
                setup=steps(tiny_model("my-model"), write("my-model/tokenizer.json", "{}")), kept=("my-model",), kind="model"),
    Case("model-folder-without-weights", "model", "a model folder with config.json but no weights file",
         load_model("./my-model"), 2, "cannot load a causal LM from ./my-model", setup=tiny_model("my-model", weights=False),
         kept=("my-model",)),
    Case("model-config-not-json", "model", "a model folder whose config.json is not valid JSON (cut off)",
         load_model("./my-model"), 2, "./my-model", setup=steps(tiny_model("my-model"), truncate("my-model/config.json")),
         kept=("my-model",)),
    Case("model-weights-truncated", "model", "a model folder whose model.safetensors was cut off (an interrupted copy)",
         load_model("./my-model"), 2, "./my-model", setup=steps(tiny_model("my-model"), truncate("my-model/model.safetensors")),
         kept=("my-model",)),
    Case("model-type-unknown", "model", "a config.json whose model_type this transformers does not know (a newer model)",
         load_model("./my-model"), 2, "./my-model",
         setup=steps(tiny_model("my-model"), edit_json("my-model/config.json", lambda c: {**c, "model_type": "gpt5"})),
         kept=("my-model",)),
    Case("run-model-without-config", "model", "a run's model/ folder that lost its config.json",
         load_model(f"{CELL}/lr~0.001/model", local_folder=True), 2, "model folder results/runs/mine",
         setup=steps(tiny_model(f"{CELL}/lr~0.001/model"), lambda f: (f / CELL / "lr~0.001/model/config.json").unlink())),
    Case("adapter-without-base", "model", "`export-merged` of a LoRA adapter that names no base model",
         cli("export-merged adapter merged"), 2, "the LoRA adapter in adapter names no base model",
         setup=write("adapter/adapter_config.json", json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8,
                                                                 "base_model_name_or_path": None, "target_modules": ["c_attn"]})),
         kept=("adapter",), absent=("merged",)),
    Case("adapter-base-missing", "model", "`export-merged` of a LoRA adapter whose base model folder was moved",
         cli("export-merged adapter merged"), 2, "is for the base model ./base-model, which cannot be loaded",
         setup=write("adapter/adapter_config.json", json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8,
                                                                 "base_model_name_or_path": "./base-model",
                                                                 "target_modules": ["c_attn"]})),
         kept=("adapter",), absent=("merged",)),
    Case("adapter-config-corrupt", "model", "`export-merged` of an adapter whose adapter_config.json was cut off",
         cli("export-merged adapter merged"), 2, "adapter",
         setup=write("adapter/adapter_config.json", '{"peft_type": "LORA", "base_model_na'), kept=("adapter",), absent=("merged",)),
    Case("export-full-model", "model", "`export-merged` of a full fine-tuning run's model (no adapter to merge)",
         cli("export-merged my-model merged"), 2, "my-model holds no LoRA adapter (no adapter_config.json)",
         setup=write("my-model/config.json", "{}"), kept=("my-model",), absent=("merged",)),
    Case("tokenizer-folder-without-files", "model", "`tokenizer.name` a local folder with no tokenizer files",
         train_tokenizer("./my-tokenizer"), 2, "tokenizer.name is './my-tokenizer', which could not be loaded",
         setup=write("my-tokenizer/README.md", "tokenizer goes here\n"), kept=("my-tokenizer",), absent=TOKENIZER_OUTPUTS),
    Case("tokenizer-json-corrupt", "model", "`tokenizer.name` a folder whose tokenizer.json is not valid JSON",
         train_tokenizer("./my-tokenizer"), 2, "./my-tokenizer",
         setup=steps(tokenizer_dir("my-tokenizer"), truncate("my-tokenizer/tokenizer.json")), kept=("my-tokenizer",),
         absent=TOKENIZER_OUTPUTS),

    # ============================================================ artifact
    Case("tokens-truncated", "artifact", "a truncated tokens.parquet read by the training pool",
         job(lambda f: __import__("userdp.training.pool", fromlist=["x"]).load_train_pool(
             "results/data/mine/tokens.parquet", 2, 0)), 2,
         "results/data/mine/tokens.parquet is not a readable Parquet file",
         setup=steps(tokens(), truncate("results/data/mine/tokens.parquet"))),
    Case("tokens-missing-column", "artifact", "a tokens.parquet without input_ids (written by another tool)",
         job(lambda f: __import__("userdp.training.pool", fromlist=["x"]).load_train_pool(
             "results/data/mine/tokens.parquet", 2, 0)), 2,
         "results/data/mine/tokens.parquet lacks column(s) ['input_ids']", setup=tokens(drop=["input_ids"])),
    Case("tokens-user-in-two-splits", "artifact", "a tokens.parquet where a train user also has validation rows",
         job(lambda f: __import__("userdp.training.pool", fromlist=["x"]).load_train_pool(
             "results/data/mine/tokens.parquet", 2, 0)), 2, "splits must be user-disjoint",
         setup=tokens(shared_user=True)),
    Case("tokens-without-metadata", "artifact", "a tokens.parquet without its userdp schema metadata (rewritten by pandas)",
         job(lambda f: __import__("userdp.data.canaries", fromlist=["x"]).tokens_meta(
             __import__("userdp.io", fromlist=["x"]).read_schema("results/data/mine/tokens.parquet"),
             "results/data/mine/tokens.parquet")), 2,
         "results/data/mine/tokens.parquet has no 'userdp' schema metadata", setup=tokens(metadata={})),
    Case("users-truncated", "artifact", "a truncated users.parquet read by the plan", plan_job(), 2,
         "results/data/mine/users.parquet is not a readable Parquet file",
         setup=steps(users_parquet(), truncate("results/data/mine/users.parquet"), contributions()), absent=(PLAN,)),
    Case("users-missing-column", "artifact", "a users.parquet without n_examples", plan_job(), 2,
         "results/data/mine/users.parquet has no column n_examples: it was written by another version",
         setup=steps(users_parquet(drop="n_examples"), contributions()), absent=(PLAN,)),
    Case("users-no-train", "artifact", "a users.parquet with no train users", plan_job(), 2,
         "results/data/mine/users.parquet has no users with split == 'train'",
         setup=steps(users_parquet(splits=("validation", "test")), contributions()), absent=(PLAN,)),
    Case("adaptive-count-noise-too-small", "config", "adaptive clipping whose count noise would spend the whole "
         "step's budget", plan_job(privacy={"clipping": "adaptive", "adaptive": {"count_noise": 0.001}}), 2,
         "raise privacy.adaptive.count_noise above",
         setup=steps(users_parquet(splits=("train",) * 60 + ("validation", "test")), contributions(train=60)),
         absent=(PLAN,)),
    Case("correlated-noise-rate-above-one", "config", "banded DP-FTRL with more bands than the batch allows (each "
         "step samples one partition of N / b users)",
         plan_job(privacy={"correlated_noise": {"bands": 4}}, method="uls"), 2,
         "with privacy.correlated_noise.bands = 4 a step samples from one partition",
         setup=steps(users_parquet(splits=("train",) * 60 + ("validation", "test")), contributions(train=60)),
         absent=(PLAN,)),
    Case("contributions-truncated", "artifact", "a contributions.json cut off (a full disk)", plan_job(), 2,
         "results/data/mine/contributions.json is not a readable JSON file",
         setup=steps(users_parquet(), write("results/data/mine/contributions.json", '{"dataset": "mine", "n_us')),
         absent=(PLAN,)),
    Case("contributions-no-validation-users", "artifact", "a dataset so small its split has no validation users",
         plan_job(), 2, "results/data/mine/contributions.json: dataset 'mine' has no validation users",
         setup=steps(users_parquet(), contributions(validation=0)), absent=(PLAN,)),
    Case("contributions-dp-malformed", "artifact", "a DP contribution-statistics release with its bins missing",
         plan_job(private_stats=True), 2, "results/data/mine/contributions_dp.json is not a contribution statistics release",
         setup=steps(users_parquet(), contributions(), write("results/data/mine/contributions_dp.json",
                                                              json.dumps({"epsilon": 0.1, "mechanism": "laplace"}))),
         absent=(PLAN,)),
    Case("eval-truncated", "artifact", "a learning-rate run's eval.json cut off", select_job(), 2,
         f"{CELL}/lr~0.001/eval.json is not a readable JSON file", setup=lr_runs('{"validation_loss": 3.'),
         absent=CELL_OUTPUTS),
    Case("eval-without-test-loss", "artifact", "an eval.json without test_loss (written by an older version)",
         select_job(), 2, "eval.json of learning rate 0.001 lacks ['test_loss']",
         setup=lr_runs('{"validation_loss": 3.5}'), absent=CELL_OUTPUTS),
    Case("train-log-missing", "artifact", "the chosen run's train_log.parquet deleted by hand", select_job(), 2,
         f"{CELL}/lr~0.001/train_log.parquet does not exist",
         setup=steps(lr_runs(), lambda f: (f / CELL / "lr~0.001/train_log.parquet").unlink()), absent=CELL_OUTPUTS),
    Case("checkpoint-not-a-state", "artifact", "a checkpoint/state.pt that holds a list, not a training state",
         load_checkpoint_job(), 2, "holds a list, not a training state", setup=checkpoint(lambda f: [1, 2, 3])),
    Case("checkpoint-truncated", "artifact", "a checkpoint/state.pt cut off (the disk filled up)", load_checkpoint_job(), 2,
         "state.pt cannot be read", setup=steps(checkpoint(lambda f: {"step": 3, "w": __import__("torch").zeros(64)}),
                                                 truncate(f"{CELL}/lr~0.001/checkpoint/state.pt"))),
    Case("checkpoint-empty", "artifact", "an empty (0-byte) checkpoint/state.pt", load_checkpoint_job(), 2,
         "state.pt cannot be read", setup=checkpoint(raw=b"")),
    Case("checkpoint-runs-code", "artifact", "a checkpoint/state.pt holding an object whose unpickling runs code",
         load_checkpoint_job(), 2, "holds objects other than tensors and plain values",
         setup=checkpoint(lambda f: {"fingerprint": "x", "payload": _OpensAFile()}), absent=("code_ran",)),
    Case("public-parquet-empty", "artifact", "a public.parquet with no rows for the tokenizer", train_tokenizer(None), 2,
         "results/data/synth/public.parquet: no public text to train the tokenizer on",
         setup=parquet("results/data/synth/public.parquet", {"text": __import__("pyarrow").array([], "string")}),
         absent=TOKENIZER_OUTPUTS),
    Case("public-parquet-truncated", "artifact", "a truncated public.parquet for the tokenizer", train_tokenizer(None), 2,
         "results/data/synth/public.parquet is not a readable Parquet file",
         setup=steps(parquet("results/data/synth/public.parquet", {"text": ["some public text"] * 50}),
                     truncate("results/data/synth/public.parquet")), absent=TOKENIZER_OUTPUTS),
    Case("tokenizer-missing", "artifact", "results/tokenizer without tokenizer.json (deleted by hand)",
         job(lambda f: __import__("userdp.training.models", fromlist=["x"]).load_tokenizer("results/tokenizer")), 2,
         "no tokenizer at results/tokenizer", setup=write("results/tokenizer/tokenizer_info.json", "{}")),
    Case("tokenizer-truncated", "artifact", "a truncated results/tokenizer/tokenizer.json read by the tokenize rule",
         tokenize_job(), 2, "results/tokenizer/tokenizer.json",
         setup=steps(tokenizer_dir(), truncate("results/tokenizer/tokenizer.json"),
                     parquet("results/data/mine/examples.parquet", {"user_id": ["a"], "example_id": [0], "split": ["train"],
                                                                   "text": ["hello"]})),
         absent=("results/data/mine/tokens.parquet",)),
    Case("examples-truncated", "artifact", "a truncated examples.parquet read by the tokenize rule", tokenize_job(), 2,
         "results/data/mine/examples.parquet is not a readable Parquet file",
         setup=steps(tokenizer_dir(), parquet("results/data/mine/examples.parquet",
                                              {"user_id": ["a"] * 40, "example_id": list(range(40)), "split": ["train"] * 40,
                                               "text": ["hello there"] * 40}),
                     truncate("results/data/mine/examples.parquet")),
         absent=("results/data/mine/tokens.parquet",)),
]



# ---------------------------------------------------------------- the docs page

HEADER = """\
# Bad-input catalogue

<!-- Generated by `python tests/bad_input_catalogue.py > docs/catalogue.md`; do not edit by hand. -->

Every bad input below is a case of one table, `CASES` in
[tests/bad_input_catalogue.py](../tests/bad_input_catalogue.py), and a test of
[tests/test_catalogue.py](../tests/test_catalogue.py). The rule each case checks: bad input (a config key, a data
file, an argument, a model folder, a corrupted artifact) gets an error message that **names the file or key, says
what is wrong and how to fix it**, a **non-zero exit** (2 for userdp's own errors), **no traceback**, **no
half-written artifact** (the case's outputs and every temporary file of an atomic write are absent afterwards) and
**nothing the user already had is lost** (the case's `kept` files keep their bytes).

Run the catalogue: `python -m pytest -q -p no:cacheprovider tests/test_catalogue.py` (in-process, well under a
minute; two cases run a real `snakemake -n`). Regenerate this page after changing a case or a message:
`python tests/bad_input_catalogue.py > docs/catalogue.md` (tests/test_catalogue.py fails when the ids listed here
and the table's differ). The messages below are the real ones, produced by running each case; the case's temporary
folder is written `<tmp>`. A *known gap* is a case that does not meet the rule today: it is a strict xfail with the
behaviour it should have, and its row shows what happens now.

History: when the table was first run (2026-12-02, 188 cases), 179 met the rule and 9 did not (duplicate YAML
keys accepted silently, two wrong spelling hints, a tokenizer.public_dataset without public text found only
while building the DAG, tracebacks for a truncated safetensors file, an unknown model_type, a damaged
adapter_config.json and a truncated tokenizer.json, and a cell ledger written before a missing train log was
found); all 9 were fixed the same day. The faults at the end were tests before the table and stay their own.
"""


def _clean(text: str, folder: Path) -> str:
    for prefix in sorted({str(folder), os.path.realpath(folder)}, key=len, reverse=True):
        text = text.replace(prefix, "<tmp>")
    return text.replace(str(REPO), "<repo>")


_NOISE = re.compile(r"^(Using workflow specific profile|Assuming unrestricted|Building DAG|Config file|  File |usage:|"
                    r"\s{2,}\S|\s*$)")


def display_message(result: Result, folder: Path) -> str:
    """The message a user sees, for the docs: the error line(s) (a traceback's last line), `<tmp>` for the folder."""
    text = _clean(result.text, folder)
    lines = text.splitlines()
    if "Traceback (most recent call last)" in text:
        raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\w*: ", line)]
        last = (raised or [line for line in lines if line.strip()])[-1].strip()
        return f"Traceback (most recent call last): ... {last if len(last) <= 400 else last[:400] + ' ...'}"
    start = next((i for i, line in enumerate(lines) if re.search(r"(?i)\berror\b", line)), 0)
    kept = [line.strip() for line in lines[start:] if not _NOISE.match(line)]
    shown = " ".join(kept)
    if not shown:
        return f"(nothing printed; exit {result.outcome.exit})"
    return shown if len(shown) <= 1500 else shown[:1500] + " ..."


def _code(text: str) -> str:
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class Fault:
    """A kill or stop of a running job, run with a real signal and a small config by its own test (`test`, a
    pytest node id): they need processes, timing and a whole pipeline stage, not one call and its message."""

    id: str
    what: str      # the fault, as it happens
    outcome: str   # what the test checks
    test: str      # tests/FILE.py::TEST_NAME


FAULTS: list[Fault] = [
    Fault("sigterm-finetune", "SIGTERM to a fine-tuning job (SLURM preemption or time limit)",
          "the step in progress finishes, the checkpoint is saved atomically, exit 143; the resumed run is "
          "bitwise equal to an uninterrupted one",
          "tests/test_train_engine.py::test_sigterm_saves_a_checkpoint_after_the_step_and_the_resumed_run_is_identical"),
    Fault("crash-finetune-resume", "a fine-tuning job killed between checkpoints (ELS, ULS, reference gradients)",
          "the rerun resumes from the last checkpoint and its model, log and ledger equal an uninterrupted run's",
          "tests/test_train_engine.py::test_resume_reproduces_uninterrupted_run"),
    Fault("sigterm-atomic-write", "SIGTERM while an artifact is being written",
          "no temporary file and no artifact are left (the default SIGTERM action would leave the temp file)",
          "tests/test_io_interrupts.py::test_sigterm_during_an_atomic_write_leaves_nothing"),
    Fault("kill9-tokenize", "kill -9 of a tokenize job with 2 worker processes",
          "the workers exit within seconds (they used to block forever at PID 1); the rerun removes the killed "
          "job's hidden .tokens.parquet.*.tmp and writes the artifact",
          "tests/test_data_tokenize.py::test_kill_9_of_tokenize_ends_its_workers_and_the_rerun_removes_its_temp_file"),
    Fault("kill9-snakemake", "kill -9 of snakemake while a fine-tuning job runs; then --unlock, --rerun-incomplete",
          "the orphaned job finishes; the rerun restores its outputs bit for bit from finished/ instead of "
          "training again, the log keeps the finishing attempt, and a dry run has nothing left to do",
          "tests/test_fault_kills.py::test_stopping_snakemake_never_redoes_finished_training"),
    Fault("sigterm-snakemake", "SIGTERM to snakemake (`kill PID`) while a fine-tuning job runs",
          "no new job starts; the running job finishes and is recorded; exit 1 with 'At least one job did not "
          "complete successfully' (the jobs never started, docs/operations.md); the next run does only those",
          "tests/test_fault_kills.py::test_stopping_snakemake_never_redoes_finished_training"),
    Fault("rerun-after-outputs-deleted", "a finished run's outputs deleted by snakemake before a rerun",
          "restored without a training step; any change of plan, settings, code or a recorded file trains again",
          "tests/test_train_finished.py::test_rerun_after_outputs_deleted_restores_without_training"),
    Fault("kill-random-stopping", "a random-stopping cell job killed after some of its runs",
          "the rerun resumes the same draw and does not retrain finished runs",
          "tests/test_random_stopping.py::test_a_killed_job_resumes_the_same_draw_without_retraining_finished_runs"),
    Fault("rerun-log-append", "a job rerun after a kill", "its log keeps the earlier attempts' lines, each later "
          "attempt marked", "tests/test_io_interrupts.py::test_a_rerun_job_appends_to_its_log_and_marks_the_attempt"),
    Fault("rerun-stale-run-folder", "a fine-tuning rerun that fails early, in a folder of an earlier model",
          "the earlier model's leftovers (model/ extras, eval.json) are gone; the user's own files stay",
          "tests/test_train_job.py::test_a_failed_rerun_leaves_no_files_of_the_earlier_model"),
    Fault("stale-tokenizer", "a failed tokenizer rerun after snakemake deleted tokenizer.json",
          "no companion files of the old tokenizer remain; a good rerun writes a whole tokenizer",
          "tests/test_data_tokenize.py::test_a_failed_tokenizer_load_leaves_no_stale_companions"),
]


def run_all(cases: Iterable[Case] = None) -> list[tuple[Case, Result, str]]:
    """Run every case in its own temporary folder; (case, result, message as shown in the docs)."""
    out = []
    for case in CASES if cases is None else cases:
        with tempfile.TemporaryDirectory(prefix="userdp-catalogue-") as tmp:
            result = execute(case, tmp)
            out.append((case, result, display_message(result, Path(tmp))))
    return out


def markdown(results: list[tuple[Case, Result, str]] | None = None) -> str:
    """The catalogue as a Markdown page: a summary, then one table per kind with every case's real message."""
    results = run_all() if results is None else results
    parts = [HEADER]
    gaps = [c for c, _, _ in results if c.xfail]
    parts.append("| kind | cases | known gaps |\n|---|---:|---:|")
    for kind in KINDS:
        n = sum(c.kind == kind for c, _, _ in results)
        g = sum(c.kind == kind and c.xfail for c, _, _ in results)
        parts.append(f"| [{kind}](#{kind}) | {n} | {g} |")
    parts.append(f"| **all** | **{len(results)}** | **{len(gaps)}** |")
    parts.append(f"| [faults](#faults) | {len(FAULTS)} (own tests) | |\n")
    for kind in KINDS:
        parts.append(f'<a id="{kind}"></a>\n\n## {KIND_TITLES[kind]}\n')
        parts.append("| id | bad input | exit | message |\n|---|---|---|---|")
        for case, result, msg in results:
            if case.kind != kind:
                continue
            if case.xfail:
                exit_text = f"{case.exit} (today {result.outcome.exit})"
                msg_text = f"**Known gap:** {_cell(case.reason)} Today: {_code(msg)}"
            else:
                exit_text = str(result.outcome.exit)
                msg_text = _code(msg)
            parts.append(f"| `{case.id}` | {_cell(case.what)} | {exit_text} | {msg_text} |")
        parts.append("")
    parts.append('<a id="faults"></a>\n\n## Faults (kills and stops, with real signals)\n')
    parts.append("Each is a test of its own (processes, timing, a pipeline stage): the table names it. "
                 "`tests/test_catalogue.py` checks that every test named here exists.\n")
    parts.append("| id | fault | what the test checks | test |\n|---|---|---|---|")
    for f in FAULTS:
        parts.append(f"| `{f.id}` | {_cell(f.what)} | {_cell(f.outcome)} | `{f.test}` |")
    return "\n".join(parts) + "\n"


def listed_ids(markdown_text: str) -> list[str]:
    """The case ids a catalogue page lists (its table rows), in order."""
    cases_part = markdown_text.split('<a id="faults"></a>')[0]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", cases_part, re.M)


if __name__ == "__main__":
    import time

    t0 = time.monotonic()
    results = run_all()
    sys.stdout.write(markdown(results))
    bad = [c.id for c, r, _ in results if not c.xfail and (r.outcome.exit != c.exit or c.message not in r.text
                                                          or r.leftovers or r.changed)]
    print(f"{len(results)} cases in {time.monotonic() - t0:.1f} s; not as expected: {bad or 'none'}", file=sys.stderr)
