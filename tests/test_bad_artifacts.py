"""A truncated or overwritten Parquet artifact is reported by name with how to rebuild it, not as pyarrow's
"Parquet magic bytes not found" without a file (issue: every stage names the unreadable file)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from train_fixtures import tokens_table
from userdp import io
from userdp.errors import DataError


@pytest.fixture
def truncated(tmp_path):
    path = tmp_path / "results" / "data" / "d" / "tokens.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(tokens_table(10, seed=1), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a job killed while another tool copied it, a full disk, ...
    return path


@pytest.mark.parametrize("reader", [
    lambda p: io.read_table(p), lambda p: io.read_frame(p), lambda p: io.read_schema(p),
    lambda p: io.streaming_parquet(p),
    lambda p: __import__("userdp.training.pool", fromlist=["x"]).load_train_pool(str(p), 2, 0),
    lambda p: __import__("userdp.privacy.planner", fromlist=["x"]).read_train_token_counts(str(p)),
], ids=["read_table", "read_frame", "read_schema", "streaming", "train_pool", "planner_counts"])
def test_truncated_artifact_is_named_with_the_fix(truncated, reader):
    with pytest.raises(DataError) as exc:
        reader(truncated)
    msg = str(exc.value)
    assert str(truncated) in msg and "not a readable Parquet file" in msg and "rerun snakemake" in msg


def test_missing_artifact_is_named(tmp_path):
    with pytest.raises(DataError, match=r"x\.parquet does not exist; rerun snakemake"):
        io.read_table(tmp_path / "x.parquet")


def test_a_users_own_parquet_keeps_the_loaders_message(tmp_path, truncated):
    from userdp.data.local import LocalSource

    src = LocalSource("mine", {"source": "local", "path": str(truncated)}, tmp_path / "data")
    with pytest.raises(DataError) as exc:
        list(src.iter_batches(4))
    assert "not a valid Parquet file" in str(exc.value) and "pipeline artifact" not in str(exc.value)


@pytest.mark.parametrize("content", [b'{"method": "els", "sigma"', b"", b"\xff\xfe not utf-8", b"<html>"])
def test_truncated_or_foreign_json_artifact_is_named_with_the_fix(tmp_path, content):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(DataError) as exc:
        io.read_json(path)
    msg = str(exc.value)
    assert str(path) in msg and "not a readable JSON file" in msg and "rerun snakemake" in msg
