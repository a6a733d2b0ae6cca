"""Temporary files of killed writers: named by host and pid, removed by the next write of the same target."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from userdp import io


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.helper_process
def test_the_next_write_removes_leftovers_of_dead_processes_only(tmp_path):
    target = tmp_path / "tokens.parquet"
    dead = tmp_path / f".tokens.parquet.{io._HOST}-{dead_pid()}.abc.tmp"
    dead_dir = tmp_path / f".tokens.parquet.{io._HOST}-{dead_pid()}.dir.tmp"
    live = tmp_path / f".tokens.parquet.{io._HOST}-{os.getppid()}.abc.tmp"      # a running process
    other_host = tmp_path / ".tokens.parquet.elsewhere-1.abc.tmp"                # maybe running there
    other_target = tmp_path / f".tokens.parquet.bak.{io._HOST}-{dead_pid()}.x.tmp"  # another file's temp
    user_file = tmp_path / ".tokens.parquet.notes"                               # not a temp name at all
    for p in (dead, live, other_host, other_target, user_file):
        p.write_bytes(b"x")
    dead_dir.mkdir()
    (dead_dir / "model.safetensors").write_bytes(b"x")
    io.write_json(target, {"a": 1})
    left = {p.name for p in tmp_path.iterdir()}
    assert dead.name not in left and dead_dir.name not in left
    assert {live.name, other_host.name, other_target.name, user_file.name, target.name} <= left


def test_temp_names_carry_host_and_pid(tmp_path):
    prefix = io.temp_prefix(tmp_path / "x.json")
    assert prefix == f".x.json.{io._HOST}-{os.getpid()}." and "." not in io._HOST
    d = io.make_temp_dir(tmp_path / "model")
    assert d.name.startswith(f".model.{io._HOST}-{os.getpid()}.") and d.is_dir()


def _square(x):
    return x * x


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_process_pools_work_under_every_start_method(method):
    """The parent watch must not end workers whose parent is a fork server (Python 3.14's Linux default)."""
    import multiprocessing

    from userdp.workers import process_pool

    with process_pool(2, mp_context=multiprocessing.get_context(method)) as pool:
        assert list(pool.map(_square, range(6))) == [0, 1, 4, 9, 16, 25]
