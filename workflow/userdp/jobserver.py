"""Fork server for the start-up of local workflow jobs (docs/operations.md, "The job fork server").

Every `script:` job is a fresh Python process that imports torch, transformers, dp_accounting, pandas,
pyarrow and matplotlib before it does seconds of work. In a local run (`snakemake --cores N`) the main
Snakemake process starts one server (`start`, from the `onstart` hook of workflow/rules/common.smk) that
imports those modules once and listens on a UNIX socket whose path is in the environment variable
`USERDP_JOB_SERVER`. Each workflow script's first statement is `delegate(snakemake)`: when the server is
reachable it sends the job (script path, the `snakemake` object, cwd, sys.argv, sys.path, the environment
and its stdin/stdout/stderr descriptors) and the server forks a child that runs the script with those;
the client waits for the child's exit status and exits with it, forwarding SIGTERM and SIGINT. When the
server is not there (the variable unset or "", another host, the socket gone, a protocol error before
the job started) `delegate` returns and the script runs in its own process as without the server: so on
cluster nodes, under `--executor`, and when a test runs a script directly.

Processes: the server runs no Python thread besides the main one (it checks before it serves; native
pools that imports start, OpenBLAS and jemalloc, handle fork themselves) and only accepts and forks; for each connection a *supervisor* child speaks the
protocol, forks the *job* child (its own process group), relays the job's pid and then its wait status,
and exits; the server reaps supervisors. When the client goes away while the job runs (Snakemake killed
the job with SIGKILL) the supervisor kills the job's process group with SIGKILL, as the kill would have
done to the job run in-process. The server exits when the Snakemake process that started it is gone (the
pipe on its stdin closes), on SIGTERM, or on `stop`.

This module imports nothing heavy at module level (the client runs before a script's imports); the
server imports the preload list by name.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys
import time

#: Socket path of this run's server; "" turns delegation off (and keeps the workflow from starting one).
ENV = "USERDP_JOB_SERVER"
PROTOCOL = 1
#: Seconds a client waits for the greeting (the server accepts once it has imported the preload list).
GREETING_TIMEOUT_S = 300.0
#: Third-party modules the scripts import (directly or through userdp); the userdp modules are added from
#: the scripts' own imports (`script_imports`).
PRELOAD_THIRD_PARTY = (
    "numpy", "scipy.stats", "pandas", "pyarrow", "pyarrow.parquet", "pyarrow.compute", "yaml",
    "torch", "torch.nn.functional", "dp_accounting", "dp_accounting.rdp", "dp_accounting.pld",
    "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast", "tokenizers",
    "matplotlib", "matplotlib.pyplot", "snakemake.iocontainers", "snakemake.logging",
)
#: Attributes of lazily-importing packages to resolve in the server (transformers loads them on access).
PRELOAD_ATTRIBUTES = (
    ("transformers", "AutoModelForCausalLM"), ("transformers", "AutoTokenizer"), ("transformers", "AutoConfig"),
    ("transformers", "GPT2Config"), ("transformers", "GPT2LMHeadModel"), ("transformers", "PreTrainedTokenizerFast"),
)

_DIR_PREFIX = "userdp-js-"  # start()'s socket folder under /tmp
_IN_JOB = False  # set in a job child: its script's delegate() returns at once
_HEADER = struct.Struct("!Q")


class ProtocolError(Exception):
    """The server or client broke the protocol (or went away) before the job started."""


# ------------------------------------------------------------------------------------------ identity


def host_id() -> str:
    """This host and boot: a server on another machine (a shared socket path) is not used."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def identity() -> dict:
    """What a client and the server must share for a forked job to be the job run in-process: the host, the
    interpreter and the userdp package they import."""
    pkg = sys.modules.get("userdp")
    return {
        "protocol": PROTOCOL,
        "host": host_id(),
        "python": os.path.realpath(sys.executable),
        "version": sys.version,
        "userdp": os.path.realpath(pkg.__file__) if pkg is not None and getattr(pkg, "__file__", None) else None,
    }


# ------------------------------------------------------------------------------------------ framing


def send_msg(sock: socket.socket, obj, fds: list[int] | None = None) -> None:
    """One length-prefixed pickle; `fds` ride on the header (SCM_RIGHTS)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, maxfds: int = 0):
    """(object, fds) of one `send_msg`."""
    fds: list[int] = []
    if maxfds:
        header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, maxfds)
        if len(header) < _HEADER.size:
            header += _recv_exact(sock, _HEADER.size - len(header)) if header else b""
        if len(header) < _HEADER.size:
            for fd in fds:
                os.close(fd)
            raise ProtocolError("connection closed before a message")
    else:
        header = _recv_exact(sock, _HEADER.size)
    (n,) = _HEADER.unpack(header)
    try:
        return pickle.loads(_recv_exact(sock, n)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# ------------------------------------------------------------------------------------------ client


def _connect(path: str) -> socket.socket | None:
    """A connection with a matching greeting, or None (and the reason is the script's to not care about)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(GREETING_TIMEOUT_S)
        sock.connect(path)
        greeting, _ = recv_msg(sock)
        if not isinstance(greeting, dict) or greeting.get("identity") != identity():
            raise ProtocolError(f"server {path} is not this interpreter's: {greeting!r}")
        sock.settimeout(None)
        return sock
    except (OSError, ProtocolError, pickle.UnpicklingError, EOFError, ValueError):
        sock.close()
        return None


def job_request(snakemake_obj, script: str) -> dict:
    """What the job child needs to be this script's process."""
    return {
        "script": os.path.realpath(script),
        "snakemake": pickle.dumps(snakemake_obj, protocol=pickle.HIGHEST_PROTOCOL),
        "cwd": os.getcwd(),
        "argv": list(sys.argv),
        "path": list(sys.path),
        "environ": dict(os.environ),
        "rule": getattr(snakemake_obj, "rule", None),
    }


def delegate(snakemake_obj, script: str | None = None) -> None:
    """Run the calling workflow script in a child of the job server and exit with its status; or return
    (no server, or not usable) and let the script run in this process.

    `script` defaults to the caller's `__file__` (Snakemake's preamble sets it to the real script path).
    """
    if _IN_JOB:
        return
    path = os.environ.get(ENV, "")
    if not path or snakemake_obj is None:
        return
    if script is None:
        script = sys._getframe(1).f_globals.get("__file__")  # noqa: SLF001 - the calling script
        if not script:
            return
    sock = _connect(path)
    if sock is None:
        return
    try:
        send_msg(sock, job_request(snakemake_obj, script), fds=[0, 1, 2])
        reply, _ = recv_msg(sock)
        pid = int(reply["pid"])
    except (OSError, ProtocolError, KeyError, TypeError, ValueError, pickle.PicklingError, EOFError):
        sock.close()
        return  # the job did not start: run it here
    _wait_for_job(sock, pid)


def _forward(pid: int):
    def handler(signum, _frame):
        try:
            if signum == signal.SIGINT:
                os.killpg(pid, signum)  # as Ctrl-C reaches the whole foreground group
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass

    return handler


def _wait_for_job(sock: socket.socket, pid: int) -> None:
    """Forward SIGTERM/SIGINT to the job until its status arrives; exit as the job did."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward(pid))
    try:
        reply, _ = recv_msg(sock)
        status = int(reply["status"])
    except (OSError, ProtocolError, KeyError, TypeError, ValueError, EOFError) as exc:
        print(f"userdp.jobserver: lost the job server while job pid {pid} ran ({exc})", file=sys.stderr)
        os._exit(1)
    exit_like(status)


def exit_like(status: int) -> None:
    """Exit this process as a process with wait status `status` did (same code, or the same signal)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# ------------------------------------------------------------------------------------------ server


def script_imports(scripts_dir: str) -> list[str]:
    """Absolute module names imported anywhere in the workflow scripts (top level and in functions)."""
    import ast

    names: list[str] = []
    for fname in sorted(os.listdir(scripts_dir)):
        if not fname.endswith(".py"):
            continue
        with open(os.path.join(scripts_dir, fname), encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), fname)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module)
                names += [f"{node.module}.{a.name}" for a in node.names]  # submodules imported by name
    return list(dict.fromkeys(names))


def default_preload() -> list[str]:
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    mods = list(PRELOAD_THIRD_PARTY)
    if os.path.isdir(scripts):
        mods += [m for m in script_imports(scripts) if m.split(".")[0] == "userdp"]
    return list(dict.fromkeys(mods))


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def preload(modules: list[str], log) -> list[str]:
    """Import `modules` (a name that is an attribute, not a module, is skipped); the names imported."""
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except ImportError:
            pass  # `from pkg import function` names no module
        except Exception as exc:
            log(f"preload {name} failed: {type(exc).__name__}: {exc}")
    for mod, attr in PRELOAD_ATTRIBUTES:
        if mod in sys.modules:
            try:
                getattr(sys.modules[mod], attr)
            except Exception as exc:
                log(f"preload {mod}.{attr} failed: {type(exc).__name__}: {exc}")
    if "matplotlib" in sys.modules:
        try:
            warm_matplotlib()
        except Exception as exc:
            log(f"matplotlib warm-up failed: {type(exc).__name__}: {exc}")
    if "transformers" in sys.modules:
        try:
            warm_transformers()
        except Exception as exc:
            log(f"transformers warm-up failed: {type(exc).__name__}: {exc}")
    return done


def warm_transformers() -> None:
    """Build transformers' table of checkpoint conversions (every model type's weight renamings, a few
    hundred compiled regular expressions, ~0.08 s) that its first `from_pretrained` in a process builds and
    keeps in a module global; each forked job that loads a model then finds it. Loading reads a copy of
    its model type's entry, so the table is the one the job would have built.
    """
    from transformers import conversion_mapping

    conversion_mapping.get_checkpoint_conversion_mapping("gpt2")


def warm_matplotlib() -> None:
    """Draw a throwaway figure with math text to PNG and PDF in memory, so that every forked figure job
    inherits what matplotlib builds on first use and keeps: the math-text parser (a class-level pyparsing
    grammar, ~0.5 s), the Agg and PDF backends and the fonts they load. The object API only: pyplot's
    figure list and rcParams are untouched, so a figure's output does not depend on this.
    """
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([1, 2], [1, 2], label=r"$\varepsilon = 1$")
    ax.set_xscale("log")
    ax.set_xlabel(r"$\sigma$ (noise multiplier)")
    ax.legend()
    fig.tight_layout()
    for fmt in ("png", "pdf"):
        fig.savefig(io.BytesIO(), format=fmt)


def fork_safety_problems() -> list[str]:
    """Why forking this process would not give jobs a clean start (empty: safe)."""
    import threading

    problems = []
    if threading.active_count() != 1:
        problems.append(f"{threading.active_count()} Python threads after the preload (forking needs one)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        problems.append("CUDA is initialised")
    return problems


#: A line of the server's log: "<local time> [<writer pid>] <message>" (`_Log`); the job lines the reader
#: below parses are written by `_serve_one` ("job pid P rule R started: ...") and `_wait_job` ("job pid P: cpu
#: C s (system S s), max rss M MB").
_LOG_TIME = "%Y-%m-%d %H:%M:%S"


def read_job_log(path: str | os.PathLike) -> list[tuple[str, float, float]]:
    """(rule, start as a POSIX time, CPU seconds) of each job a server's log shows started and reaped."""
    import re

    line_re = re.compile(r"^(\S+ \S+) \[\d+\] job pid (\d+)(?: rule (\w+) started|: cpu ([\d.]+) s)")
    started: dict[str, tuple[str, float]] = {}
    jobs = []
    with open(path, errors="replace") as f:
        for line in f:
            m = line_re.match(line)
            if not m:
                continue
            when = time.mktime(time.strptime(m.group(1), _LOG_TIME))
            if m.group(3):
                started[m.group(2)] = (m.group(3), when)
            elif m.group(2) in started:
                rule, start = started.pop(m.group(2))
                jobs.append((rule, start, float(m.group(4))))
    return jobs


class _Log:
    def __init__(self, path: str | None):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def __call__(self, msg: str) -> None:
        if self.fd is not None:
            line = f"{time.strftime(_LOG_TIME)} [{os.getpid()}] {msg}\n"
            os.write(self.fd, line.encode("utf-8", "backslashreplace"))


def serve(sock_path: str, modules: list[str], log_path: str | None = None, parent_fd: int | None = None) -> int:
    """Bind, import `modules`, then accept jobs until stopped. Returns the exit code."""
    log = _Log(log_path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(sock_path)
    lsock.listen(128)  # clients queue here while the preload runs
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is Snakemake's to handle; it stops us
    log(f"server starting on {sock_path}: preloading {len(modules)} modules")
    done = preload(modules, log)
    problems = fork_safety_problems()
    if problems:
        log("not serving: " + "; ".join(problems) + " (jobs run in their own processes)")
        lsock.close()
        _unlink(sock_path)
        return 1
    me = identity()
    # Native threads the imports start (numpy's and scipy's OpenBLAS pools, pyarrow's jemalloc background
    # thread) are fork-aware (pthread_atfork handlers quiesce them; a child starts with one thread and they
    # restart on demand): counted here, not refused. Python threads are refused above.
    log(f"serving: {len(done)} modules imported, {thread_count()} native threads, rss {rss_mb():.0f} MB")
    watched = [lsock] + ([parent_fd] if parent_fd is not None else [])
    try:
        while not stop:
            try:
                ready, _, _ = select.select(watched, [], [], 1.0)
            except InterruptedError:
                ready = []
            _reap()
            if parent_fd is not None and parent_fd in ready:
                if not os.read(parent_fd, 4096):
                    log("stdin closed (stop(), or the process that started the server is gone): stopping")
                    break
            if lsock in ready:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    continue
                _flush_std()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        lsock.close()  # (the parent pipe stays open: fd 0 must not be reused before dup2)
                        code = _supervise(conn, me, log)
                    finally:
                        os._exit(code)
                conn.close()
    finally:
        lsock.close()
        _unlink(sock_path)
        if os.path.basename(os.path.dirname(sock_path)).startswith(_DIR_PREFIX):
            try:  # start()'s folder, also when its process was killed before it could remove it
                os.rmdir(os.path.dirname(sock_path))
            except OSError:
                pass
        log(f"server stopped ({', '.join(stop) or 'stdin closed'}); rss {rss_mb():.0f} MB")
    return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def rss_mb() -> float:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _supervise(conn: socket.socket, me: dict, log) -> int:
    """In the supervisor: greet, receive the job, fork it, relay its pid and status."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        send_msg(conn, {"identity": me})
        request, fds = recv_msg(conn, maxfds=3)
        if len(fds) != 3:
            raise ProtocolError(f"expected 3 descriptors, got {len(fds)}")
    except (OSError, ProtocolError, EOFError, pickle.UnpicklingError):
        return 0  # the client declined (another identity) or went away: nothing started
    pid = os.fork()
    if pid == 0:
        run_job(request, fds, conn)  # never returns
    try:
        os.setpgid(pid, pid)  # also done by the child: no window where a forwarded signal misses the group
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    log(f"job pid {pid} rule {request.get('rule')} started: {request['script']}")
    try:
        send_msg(conn, {"pid": pid})
    except OSError:
        pass  # the client is gone: _wait_job sees the closed connection
    status = _wait_job(conn, pid, log)
    log(f"job pid {pid} rule {request.get('rule')} ended: {describe_status(status)}")
    try:
        send_msg(conn, {"status": status})
    except OSError:
        pass
    return 0


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def _wait_job(conn: socket.socket, pid: int, log) -> int:
    """The job's wait status; if the client goes away first, kill the job's process group with SIGKILL."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    watch = [conn] + ([pidfd] if pidfd is not None else [])
    client_alive = True
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if not done and not client_alive:
            done, status, usage = os.wait4(pid, 0)
        if done:
            # Snakemake's benchmark files see only the client's process: the job's CPU time and peak RSS
            # (with its waited-for children) are here.
            log(f"job pid {pid}: cpu {usage.ru_utime + usage.ru_stime:.2f} s (system {usage.ru_stime:.2f} s), "
                f"max rss {usage.ru_maxrss / 1024:.0f} MB")
            return status
        ready, _, _ = select.select(watch, [], [], 0.5 if pidfd is None else None)
        if conn in ready:
            try:
                data = conn.recv(4096)  # the client sends nothing more: only its end shows here
            except OSError:
                data = b""
            if not data:
                client_alive = False
                log(f"job pid {pid}: client gone while the job ran: killing its process group")
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                watch = [w for w in watch if w is not conn]


def run_job(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the job child: become the script's process and run it; exits, never returns."""
    global _IN_JOB
    code = 1
    try:
        _IN_JOB = True
        os.setpgid(0, 0)
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in range(1, signal.NSIG):
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own start-up settings
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        if hasattr(signal, "SIGXFSZ"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        _reopen_std()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["environ"])
        sys.argv[:] = request["argv"]
        sys.path[:] = request["path"]
        _fresh_process_state()
        code = _run_script(request)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _flush_std()
        os._exit(code)


def _reopen_std() -> None:
    """New sys.stdin/stdout/stderr on the job's descriptors, buffered as a fresh interpreter would."""
    import io

    def text(fd: int, mode: str, errors: str):
        buffering = -1
        raw = io.open(fd, mode + "b", buffering=0 if mode == "w" else buffering, closefd=False)
        if mode == "w":
            raw = io.BufferedWriter(raw)
        interactive = os.isatty(fd)
        return io.TextIOWrapper(raw, encoding=sys.stdout.encoding if sys.stdout else "utf-8", errors=errors,
                                line_buffering=interactive or fd == 2, write_through=fd == 2)

    sys.stdin = sys.__stdin__ = text(0, "r", "strict")
    sys.stdout = sys.__stdout__ = text(1, "w", "strict")
    sys.stderr = sys.__stderr__ = text(2, "w", "backslashreplace")


def _fresh_process_state() -> None:
    """What a fresh interpreter starts with and the server's imports may have set up differently."""
    import logging

    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    logging.disable(logging.NOTSET)
    # numpy's legacy global generator was seeded once from OS entropy when the server imported numpy; a
    # fresh process seeds it freshly, so do the same (the project seeds its own generators explicitly; this
    # only keeps jobs from sharing one unseeded global stream). Python's `random` reseeds itself at fork.
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _run_script(request: dict) -> int:
    """Run the script as `__main__` with its `snakemake` object; the exit code Python would give."""
    import atexit
    import runpy
    import threading

    code = 0
    try:
        obj = pickle.loads(request["snakemake"])
        runpy.run_path(request["script"], init_globals={"snakemake": obj}, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        _finish(threading, atexit)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(threading, atexit)
    return code


def _finish(threading, atexit) -> None:
    """Interpreter shutdown, as far as a job can see it: wait for non-daemon threads, run atexit."""
    try:
        threading._shutdown()  # noqa: SLF001 (what Py_FinalizeEx calls)
    except Exception:
        pass
    atexit._run_exitfuncs()  # noqa: SLF001


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------------ lifecycle

_server = None  # (Popen, socket dir) of the server this process started


def start(log_path: str | None = None, modules: list[str] | None = None, wait_s: float = 30.0) -> str | None:
    """Start a server for this process's jobs and set `ENV` for them; the socket path, or None when
    `ENV` is "" (turned off) or the server did not come up (jobs then run in their own processes)."""
    global _server
    import atexit
    import subprocess
    import tempfile

    if os.environ.get(ENV) == "":
        return None
    if _server is not None:
        return os.environ.get(ENV)
    sock_dir = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir="/tmp" if os.path.isdir("/tmp") else None)
    os.chmod(sock_dir, 0o700)
    sock_path = os.path.join(sock_dir, "s")
    cmd = [sys.executable, "-m", "userdp.jobserver", "serve", "--socket", sock_path]
    if log_path:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        cmd += ["--log", os.path.abspath(log_path)]
    if modules is not None:
        cmd += ["--preload", ",".join(modules)]
    env = dict(os.environ)
    env.pop(ENV, None)
    # The server imports userdp from where this process does (the Snakefile put it on sys.path).
    pkg = sys.modules.get("userdp")
    if pkg is not None and getattr(pkg, "__file__", None):
        root = os.path.dirname(os.path.dirname(os.path.abspath(pkg.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                            start_new_session=True, close_fds=True)
    _server = (proc, sock_dir)
    atexit.register(stop)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(sock_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            return None
        time.sleep(0.02)
    os.environ[ENV] = sock_path
    return sock_path


def stop(timeout_s: float = 10.0) -> None:
    """Stop the server `start` started (closing its stdin pipe) and remove its socket folder."""
    global _server
    import shutil
    import subprocess

    if _server is None:
        return
    proc, sock_dir = _server
    _server = None
    if os.environ.get(ENV, "").startswith(sock_dir + os.sep):
        del os.environ[ENV]
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(sock_dir, ignore_errors=True)


def start_for_workflow(workflow, log_path: str | None) -> str | None:
    """`start` in the main process of a local, real run (not a dry run, --touch or a remote executor), and
    not with --software-deployment-method (conda, apptainer): those jobs run another environment's Python."""
    if not (workflow.is_main_process and workflow.local_exec and not workflow.dryrun and not workflow.touch):
        return None
    settings = getattr(workflow, "deployment_settings", None)
    if settings is not None and settings.deployment_method:
        return None
    return start(log_path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m userdp.jobserver", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve jobs on a UNIX socket until stdin closes or SIGTERM")
    s.add_argument("--socket", required=True, help="socket path (at most ~107 bytes)")
    s.add_argument("--preload", default=None, help="comma-separated modules (default: the scripts' imports)")
    s.add_argument("--log", default=None, help="append a line per job to this file")
    args = ap.parse_args(argv)
    modules = default_preload() if args.preload is None else [m for m in args.preload.split(",") if m]
    parent_fd = None if os.isatty(0) else 0
    return serve(args.socket, modules, args.log, parent_fd)


if __name__ == "__main__":
    # Run the module's own copy (`userdp.jobserver`, not `__main__`): the scripts' delegate() must see the
    # job flag that run_job sets.
    from userdp.jobserver import main as _main

    sys.exit(_main())
