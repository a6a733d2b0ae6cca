"""The job fork server (userdp.jobserver): protocol units, the client's fall-backs, and real servers.

Fast lane: the framing with descriptors over a socketpair, every fall-back of `delegate` (it returns and
the script runs in its own process), the preload list, and that every workflow script delegates first.
Integration: a real server (`start`) running small scripts that stand in for workflow scripts (exit codes,
an uncaught exception, torch threads after fork, SIGTERM forwarded, SIGKILL of the client kills the job,
a stopped server), and a real training stage run with the server and without it, bit for bit.
"""

from __future__ import annotations

import ast
import hashlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import threading
import types
from pathlib import Path

import pytest

from userdp import jobserver

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "workflow" / "scripts"


# ---------------------------------------------------------------------------------------------- fast


def test_messages_carry_objects_and_descriptors(tmp_path):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    f = tmp_path / "out.txt"
    with open(f, "w") as fh, a, b:
        payload = {"script": "/x.py", "environ": {"A": "1"}, "blob": b"\0" * 100_000}
        sender = threading.Thread(target=jobserver.send_msg, args=(a, payload, [fh.fileno()]))
        sender.start()
        got, fds = jobserver.recv_msg(b, maxfds=3)
        sender.join()
        assert got == payload and len(fds) == 1
        os.write(fds[0], b"via the passed descriptor")
        os.close(fds[0])
    assert f.read_text() == "via the passed descriptor"


def test_closed_connection_is_a_protocol_error():
    a, b = socket.socketpair()
    a.sendall(jobserver._HEADER.pack(10) + b"abc")
    a.close()
    with b, pytest.raises(jobserver.ProtocolError, match="3 of 10"):
        jobserver.recv_msg(b)


def test_snakemake_object_pickles_again_for_the_request(tmp_path):
    from snakemake.iocontainers import InputFiles, Log, OutputFiles, Params, ResourceList, Snakemake, Wildcards

    # what the preamble unpickled: pickled again by the client, unpickled by the job child
    obj = pickle.loads(pickle.dumps(Snakemake(
        InputFiles(["in.txt"]), OutputFiles(["out.txt"]), Params(), Wildcards(), 2, ResourceList(), Log(["a.log"]),
        {}, "rulename", 0, str(tmp_path)), protocol=4))
    req = jobserver.job_request(obj, str(tmp_path / "s.py"))
    back = pickle.loads(pickle.loads(pickle.dumps(req))["snakemake"])
    assert back.rule == "rulename" and list(back.output) == ["out.txt"] and back.log[0] == "a.log"
    assert back.threads == 2 and req["rule"] == "rulename" and req["environ"] == dict(os.environ)


@pytest.mark.parametrize("value", [None, ""])
def test_delegate_returns_without_a_server(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(jobserver.ENV, raising=False)
    else:
        monkeypatch.setenv(jobserver.ENV, value)
    assert jobserver.delegate({"rule": "x"}, script=__file__) is None


def test_delegate_returns_for_a_stale_socket_path(monkeypatch, tmp_path):
    monkeypatch.setenv(jobserver.ENV, str(tmp_path / "gone" / "s"))  # the server's folder was removed
    assert jobserver.delegate({"rule": "x"}, script=__file__) is None
    stale = tmp_path / "s"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(stale))
    srv.close()  # the file stays, nobody listens: connection refused
    monkeypatch.setenv(jobserver.ENV, str(stale))
    assert jobserver.delegate({"rule": "x"}, script=__file__) is None


def _one_shot_server(path: Path, greeting) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            if isinstance(greeting, bytes):
                conn.sendall(greeting)
            else:
                jobserver.send_msg(conn, greeting)
            conn.recv(1)  # until the client hangs up
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("greeting", [
    "another host",
    "another interpreter",
    "garbage",
])
def test_delegate_returns_for_a_server_it_must_not_use(monkeypatch, tmp_path, greeting):
    me = jobserver.identity()
    msg = {"another host": {"identity": {**me, "host": "elsewhere/boot"}},
           "another interpreter": {"identity": {**me, "userdp": "/other/checkout/userdp/__init__.py"}},
           "garbage": b"\0\0\0\0\0\0\0\3xyz"}[greeting]
    t = _one_shot_server(tmp_path / "s", msg)
    monkeypatch.setenv(jobserver.ENV, str(tmp_path / "s"))
    assert jobserver.delegate({"rule": "x"}, script=__file__) is None
    t.join(5)


def test_delegate_in_a_job_child_returns_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv(jobserver.ENV, str(tmp_path / "would-block"))
    monkeypatch.setattr(jobserver, "_IN_JOB", True)
    monkeypatch.setattr(jobserver, "_connect", lambda path: pytest.fail("a job child must not connect"))
    assert jobserver.delegate({"rule": "x"}, script=__file__) is None


@pytest.mark.parametrize("change, starts", [
    ({}, True),
    ({"dryrun": True}, False),
    ({"touch": True}, False),
    ({"local_exec": False}, False),  # --executor slurm and the like
    ({"is_main_process": False}, False),  # a job's own snakemake process
    ({"deployment_settings": types.SimpleNamespace(deployment_method={"conda"})}, False),
])
def test_started_only_for_the_main_process_of_a_local_run(monkeypatch, change, starts):
    calls = []
    monkeypatch.setattr(jobserver, "start", lambda log_path: calls.append(log_path) or "/tmp/x/s")
    wf = types.SimpleNamespace(is_main_process=True, local_exec=True, dryrun=False, touch=False,
                               deployment_settings=types.SimpleNamespace(deployment_method=frozenset()))
    for key, value in change.items():
        setattr(wf, key, value)
    got = jobserver.start_for_workflow(wf, "results/logs/jobserver.log")
    assert (got == "/tmp/x/s") == starts and calls == (["results/logs/jobserver.log"] if starts else [])


def test_start_is_off_when_the_variable_is_empty(monkeypatch):
    monkeypatch.setenv(jobserver.ENV, "")
    monkeypatch.setattr(jobserver, "_server", None)
    assert jobserver.start("unused.log") is None  # before any process or folder is made


def test_exit_codes_follow_the_interpreter():
    assert jobserver._exit_code(None) == 0
    assert jobserver._exit_code(3) == 3
    assert jobserver._exit_code(256 + 7) == 7
    assert jobserver._exit_code("a message") == 1


def test_preload_covers_the_heavy_modules_and_the_scripts_imports():
    mods = jobserver.default_preload()
    for heavy in ("torch", "transformers.models.gpt2.modeling_gpt2", "dp_accounting", "pandas",
                  "pyarrow.parquet", "matplotlib.pyplot"):
        assert heavy in mods
    imported = jobserver.script_imports(str(SCRIPTS))
    assert "userdp.training.finetune_job" in imported or "userdp.training" in imported
    assert {m for m in imported if m.startswith("userdp.")} <= set(mods)
    assert len(str(Path("/tmp") / "userdp-js-xxxxxxxx" / "s")) < 100  # UNIX socket paths: ~107 bytes


def _is_delegate_call(node) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "delegate"
            and [getattr(a, "id", None) for a in node.value.args] == ["snakemake"])


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_every_script_delegates_before_its_other_imports(script):
    body = ast.parse((SCRIPTS / script).read_text()).body
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), "docstring first"
    if script == "tokenize_data.py":  # spawned tokenizer workers import the file without `snakemake`
        guard = next(n for n in body if isinstance(n, ast.If))
        body = [None] + guard.body
    first, call = body[1], body[2]
    assert isinstance(first, ast.ImportFrom) and first.module == "userdp.jobserver", script
    assert _is_delegate_call(call), f"{script}: delegate(snakemake) must follow the import"


# ---------------------------------------------------------------------------------------------- real servers

CLIENT = """
import os, signal, sys, time, types
from userdp.jobserver import delegate

if "snakemake" not in globals():
    snakemake = types.SimpleNamespace(rule="stand_in")
delegate(snakemake)
from userdp import jobserver
print("delegated", jobserver._IN_JOB, "pid", os.getpid(), "rule", snakemake.rule, flush=True)
mode = os.environ.get("MODE", "exit")
if mode == "exit":
    print("an error message for the log", file=sys.stderr)
    sys.exit(int(os.environ.get("CODE", "0")))
if mode == "raise":
    raise ValueError("bad input in the stand-in script")
if mode == "torch":
    import torch
    torch.set_num_threads(2)
    x = torch.arange(16.0).reshape(4, 4)
    print("threads", torch.get_num_threads(), "sum", float((x @ x).sum()), "cwd", os.getcwd(), flush=True)
if mode == "sigterm":
    def on_term(*_):
        open(os.environ["MARK"], "w").write("checkpointed")
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    open(os.environ["PIDFILE"] + ".tmp", "w").write(str(os.getpid()))
    os.replace(os.environ["PIDFILE"] + ".tmp", os.environ["PIDFILE"])
    time.sleep(60)
    sys.exit(0)
if mode == "rng":
    import random, secrets
    import numpy as np
    print("draws", secrets.randbits(63), random.getrandbits(63), int(np.random.randint(2**62)), flush=True)
if mode == "sleep":
    open(os.environ["PIDFILE"] + ".tmp", "w").write(str(os.getpid()))
    os.replace(os.environ["PIDFILE"] + ".tmp", os.environ["PIDFILE"])
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server (start) with a small preload (torch, to check threads after fork), for this module."""
    tmp = tmp_path_factory.mktemp("js")
    saved = os.environ.get(jobserver.ENV)
    os.environ.pop(jobserver.ENV, None)
    path = jobserver.start(str(tmp / "jobserver.log"), modules=["torch", "numpy", "pandas"], wait_s=60)
    assert path and os.path.exists(path)
    yield path, tmp
    jobserver.stop()
    assert not os.path.exists(path)
    if saved is not None:
        os.environ[jobserver.ENV] = saved


def _run_client(script: Path, env_server: str | None, timeout=120, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO / "workflow"), **env)
    if env_server is None:
        e.pop(jobserver.ENV, None)
    else:
        e[jobserver.ENV] = env_server
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=script.parent)


@pytest.fixture
def client(tmp_path):
    p = tmp_path / "stand_in.py"
    p.write_text(textwrap.dedent(CLIENT))
    return p


def _wait_for(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of the supervisor counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_and_stderr_come_back(server, client, code):
    path, tmp = server
    res = _run_client(client, path, MODE="exit", CODE=str(code))
    assert res.returncode == code, res.stderr
    assert "delegated True" in res.stdout and "an error message for the log" in res.stderr
    job_pid = int(res.stdout.split("pid ")[1].split()[0])
    log = (tmp / "jobserver.log").read_text()
    assert f"job pid {job_pid} rule stand_in ended: exit {code}" in log
    # the reader that benchmarks/profile_pipeline.py uses parses what the server wrote
    records = [r for r in jobserver.read_job_log(tmp / "jobserver.log") if r[0] == "stand_in"]
    assert records and all(cpu >= 0 and abs(start - time.time()) < 600 for _, start, cpu in records)


@pytest.mark.integration
def test_forked_jobs_do_not_share_random_state(server, client):
    # secret seeds (engine: secrets.randbits) and any unseeded global generator must differ between jobs
    # forked from the one server, as between fresh processes (privacy.secret_seeds, method.md section 10)
    runs = [_run_client(client, server[0], MODE="rng") for _ in range(2)]
    draws = []
    for res in runs:
        assert res.returncode == 0 and "delegated True" in res.stdout, res.stderr
        draws.append(res.stdout.split("draws ")[1].split())
    for a, b in zip(*draws):
        assert a != b, draws


@pytest.mark.integration
def test_uncaught_exception_is_exit_1_with_the_traceback(server, client):
    res = _run_client(client, server[0], MODE="raise")
    assert res.returncode == 1 and "delegated True" in res.stdout
    assert "ValueError: bad input in the stand-in script" in res.stderr and "Traceback" in res.stderr


@pytest.mark.integration
def test_torch_threads_settable_in_the_child(server, client):
    res = _run_client(client, server[0], MODE="torch")
    assert res.returncode == 0, res.stderr
    assert "delegated True" in res.stdout and "threads 2 sum 3920.0" in res.stdout
    assert f"cwd {client.parent}" in res.stdout


@pytest.mark.integration
def test_sigterm_reaches_the_job(server, client, tmp_path):
    pidfile, mark = tmp_path / "pid", tmp_path / "mark"
    e = dict(os.environ, PYTHONPATH=str(REPO / "workflow"), MODE="sigterm", PIDFILE=str(pidfile), MARK=str(mark))
    e[jobserver.ENV] = server[0]
    proc = subprocess.Popen([sys.executable, str(client)], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert _wait_for(pidfile.exists), proc.communicate(timeout=5)
    assert int(pidfile.read_text()) != proc.pid  # the job is the server's child, not the client
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert mark.read_text() == "checkpointed" and "delegated True" in out


@pytest.mark.integration
def test_sigkill_of_the_client_kills_the_job(server, client, tmp_path):
    pidfile = tmp_path / "pid"
    e = dict(os.environ, PYTHONPATH=str(REPO / "workflow"), MODE="sleep", PIDFILE=str(pidfile))
    e[jobserver.ENV] = server[0]
    proc = subprocess.Popen([sys.executable, str(client)], env=e, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert _wait_for(pidfile.exists)
    job = int(pidfile.read_text())
    assert _alive(job)
    proc.kill()
    proc.wait(timeout=10)
    assert _wait_for(lambda: not _alive(job), timeout=30), f"job {job} outlived its killed client"
    assert "client gone while the job ran" in (server[1] / "jobserver.log").read_text()


@pytest.mark.integration
def test_server_gone_means_in_process(client, tmp_path):
    """The server exits when its parent's pipe closes (a killed Snakemake); the variable then names a
    removed socket and the script runs in its own process."""
    sock = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    srv = subprocess.Popen([sys.executable, "-m", "userdp.jobserver", "serve", "--socket", str(sock),
                            "--preload", "numpy", "--log", str(tmp_path / "js.log")], stdin=subprocess.PIPE, env=env)
    assert _wait_for(sock.exists)
    res = _run_client(client, str(sock), MODE="exit", CODE="0")
    assert res.returncode == 0 and "delegated True" in res.stdout
    srv.stdin.close()  # what the death of the parent does
    assert srv.wait(timeout=60) == 0 and not sock.exists()
    assert "stdin closed" in (tmp_path / "js.log").read_text()
    assert tmp_path.exists()  # a folder not made by start() stays
    res = _run_client(client, str(sock), MODE="exit", CODE="5")
    assert res.returncode == 5 and "delegated False" in res.stdout
    res = _run_client(client, "", MODE="exit", CODE="0")
    assert res.returncode == 0 and "delegated False" in res.stdout


@pytest.mark.integration
def test_killed_starter_leaves_no_server_and_no_folder():
    """kill -9 of the process that started the server (a killed snakemake): no orphan, no socket folder."""
    code = ("import os, sys; import userdp.jobserver as j; p = j.start(None, modules=['numpy'], wait_s=60); "
            "print(p, os.getpid(), flush=True); os.kill(os.getpid(), 9)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    env.pop(jobserver.ENV, None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == -9, res.stderr
    sock = Path(res.stdout.split()[0])
    assert sock.name == "s" and sock.parent.name.startswith("userdp-js-")
    assert _wait_for(lambda: not sock.parent.exists(), timeout=60), f"{sock.parent} outlived its starter"
    servers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(sock).encode() in _cmdline(p)]
    assert servers == []


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


# ---------------------------------------------------------------------------------------------- a real pipeline


def _artifacts(root: Path) -> dict[str, str]:
    """sha256 of every model, ledger, plan and training log the training stage wrote."""
    out = {}
    for p in sorted((root / "results").rglob("*")):
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ("ledger.json", "train_log.parquet")):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.integration
def test_training_stage_same_with_and_without_the_server(train_stage, tmp_path_factory, monkeypatch):
    """Pretraining and the fine-tuning jobs of the training stage, once delegated and once in-process."""
    from userdp.io import read_json

    off = tmp_path_factory.mktemp("off")
    shutil.copytree(train_stage.root, off, dirs_exist_ok=True)
    monkeypatch.delenv(jobserver.ENV, raising=False)
    res = train_stage.snakemake()
    assert res.returncode == 0, res.stderr[-4000:]
    on = train_stage.root

    cmd = [sys.executable, "-m", "snakemake", "-s", str(off / "Snakefile"), "--directory", str(off),
           "--configfile", str(off / "extra.yaml"), "--cores", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{jobserver.ENV: ""})
    res_off = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res_off.returncode == 0, res_off.stderr[-4000:]

    a, b = _artifacts(on), _artifacts(off)
    assert len([k for k in a if k.endswith("ledger.json") and "/finished/" not in k]) == 2  # one run per cell
    assert any("pretrained" in k for k in a) and len([k for k in a if k.endswith("model.safetensors")]) >= 3
    assert a == {k.replace(str(off), str(on)): v for k, v in b.items()}
    for ledger in (k for k in a if k.endswith("ledger.json")):
        assert read_json(on / ledger)["epsilon"] == read_json(off / ledger)["epsilon"]

    # the jobs of the first run were delegated (one start and one end line each); none of the second
    log = (on / "results/logs/jobserver.log").read_text()
    started = [ln for ln in log.splitlines() if " started: " in ln]
    rules = sorted(ln.split(" rule ")[1].split()[0] for ln in started)
    assert rules == ["finetune", "finetune", "pretrain"], log
    assert log.count(" ended: exit 0") == 3 and "server stopped" in log
    assert not (off / "results/logs/jobserver.log").exists()


@pytest.mark.integration
def test_failing_delegated_job_fails_the_run_with_its_message(train_stage, monkeypatch):
    """A fine-tuning job whose plan is not JSON: snakemake reports the job failed, its log has the reason."""
    from userdp.layout import iter_cells

    monkeypatch.delenv(jobserver.ENV, raising=False)
    root = train_stage.root
    cell = next(iter(iter_cells(train_stage.config)))
    (root / cell.plan_path).write_text("{not json")
    res = train_stage.snakemake()
    assert res.returncode != 0
    assert "Error in rule finetune" in res.stdout + res.stderr
    job_log = root / f"results/logs/finetune/tiny/method~{cell.method}/eps~8/budget~24/seed~0.log"
    assert f"error: {cell.plan_path} is not a readable JSON file" in job_log.read_text(), job_log.read_text()
    server_log = (root / "results/logs/jobserver.log").read_text()
    assert "rule finetune ended: exit 2" in server_log, server_log  # run_main's exit code for a UserError
    assert "rule finetune ended: exit 0" in server_log  # the other cell's job


def test_matplotlib_warm_up_leaves_no_state_a_figure_reads():
    """The server draws a throwaway figure before forking: no pyplot figure, rcParams or thread is left."""
    import threading

    import matplotlib
    import matplotlib.pyplot as plt

    before = (dict(matplotlib.rcParams), plt.get_fignums(), threading.active_count())
    jobserver.warm_matplotlib()
    assert (dict(matplotlib.rcParams), plt.get_fignums(), threading.active_count()) == before


def test_transformers_warm_up_builds_the_conversion_table_a_model_load_reads(monkeypatch):
    """The server builds transformers' checkpoint conversion table before forking; it is the table a job's
    first `from_pretrained` would build (so loading reads the same entries)."""
    from transformers import conversion_mapping

    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", None)
    jobserver.warm_transformers()
    table = conversion_mapping._checkpoint_conversion_mapping_cache
    assert table is not None and len(table) > 10
    assert sorted(table) == sorted(conversion_mapping._build_checkpoint_conversion_mapping())
