"""Local Parquet / JSON Lines / CSV loader: good input and every bad-input case."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from builders import LOCAL_ROWS, build_local
from userdp.data.base import RAW_SCHEMA
from userdp.data.local import LocalSource
from userdp.data.tables import find_bad_utf8
from userdp.errors import ConfigError, DataError

FORMATS = ["parquet", "jsonl", "csv"]
BAD = b"\xe9"  # latin-1 e-acute: not UTF-8
EXT = {"parquet": ".parquet", "jsonl": ".jsonl", "csv": ".csv"}


def _source(path, **spec):
    return LocalSource("mine", {"source": "local", "path": str(path), **spec}, path.parent / "data")


def _rows(source, batch_rows=4):
    batches = list(source.iter_batches(batch_rows))
    assert all(b.schema.equals(RAW_SCHEMA) and b.num_rows <= batch_rows for b in batches)
    return [r for b in batches for r in zip(*(b.column(c).to_pylist() for c in RAW_SCHEMA.names))]


def _read_error(source) -> str:
    with pytest.raises(DataError) as err:
        list(source.iter_batches(2))
    return str(err.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reads_every_format_in_batches(tmp_path, fmt):
    path = build_local(tmp_path / f"d{EXT[fmt]}", fmt)
    rows = _rows(_source(path), batch_rows=4)
    # Empty texts pass through: the prepare stage drops and counts them.
    assert rows == [(r["user_id"], r["text"], None) for r in LOCAL_ROWS]


@pytest.mark.parametrize("fmt", FORMATS)
def test_custom_columns_declared_format_and_max_examples(tmp_path, fmt):
    path = build_local(tmp_path / "data.txt", fmt, rename={"user_id": "author", "text": "body"})
    src = _source(path, format=fmt, user_column="author", text_column="body", max_examples=3)
    assert [u for u, _, _ in _rows(src, batch_rows=2)] == ["alice", "bob", "alice"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_user_ids_become_text(tmp_path, fmt):
    path = build_local(tmp_path / f"d{EXT[fmt]}", fmt, [{"user_id": 7, "text": "a"}, {"user_id": 12, "text": "b"}])
    assert [u for u, _, _ in _rows(_source(path))] == ["7", "12"]


# ---------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    msg = _read_error(_source(tmp_path / "absent.csv"))
    assert "absent.csv" in msg and "does not exist" in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_file(tmp_path, fmt):
    path = tmp_path / f"empty{EXT[fmt]}"
    path.write_bytes(b"")
    msg = _read_error(_source(path))
    assert f"empty{EXT[fmt]}" in msg and "empty" in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_columns_lists_existing_ones(tmp_path, fmt):
    path = build_local(tmp_path / f"d{EXT[fmt]}", fmt, rename={"user_id": "author"})
    msg = _read_error(_source(path))
    assert f"d{EXT[fmt]}" in msg
    assert "missing column(s) ['user_id']" in msg and "'author'" in msg and "user_column" in msg


def test_header_only_csv_and_zero_row_parquet_have_no_rows(tmp_path):
    csv_path = tmp_path / "h.csv"
    csv_path.write_text("user_id,text\n")
    assert "h.csv" in (msg := _read_error(_source(csv_path))) and "no data rows" in msg
    pq_path = tmp_path / "z.parquet"
    pq.write_table(pa.table({"user_id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), pq_path)
    assert "z.parquet" in (msg := _read_error(_source(pq_path))) and "no data rows" in msg


@pytest.mark.parametrize("fmt,where", [("parquet", "row 4"), ("jsonl", "line 4"), ("csv", "row 4")])
@pytest.mark.parametrize("value", [None, ""])
def test_null_or_empty_user_id_names_the_row(tmp_path, fmt, where, value):
    rows = [dict(r) for r in LOCAL_ROWS]
    rows[3]["user_id"] = value
    if fmt == "csv" and value is None:
        rows[3]["user_id"] = ""  # CSV has no null: an empty field
    path = build_local(tmp_path / f"d{EXT[fmt]}", fmt, rows)
    msg = _read_error(_source(path))
    assert f"d{EXT[fmt]}" in msg and where in msg and "'user_id'" in msg


def test_non_utf8_csv_names_line_and_offset(tmp_path):
    path = tmp_path / "latin.csv"
    content = b"user_id,text\nu1,hello\nu2,caf\xe9\n"
    path.write_bytes(content)
    msg = _read_error(_source(path))
    assert "latin.csv" in msg and "line 3" in msg and f"byte offset {content.index(BAD)}" in msg


def test_non_utf8_jsonl_names_line_and_offset(tmp_path):
    path = tmp_path / "latin.jsonl"
    content = b'{"user_id": "u1", "text": "ok"}\n{"user_id": "u2", "text": "caf\xe9"}\n'
    path.write_bytes(content)
    msg = _read_error(_source(path))
    assert "latin.jsonl" in msg and "line 2" in msg and f"byte offset {content.index(BAD)}" in msg


def test_non_utf8_parquet_binary_column_names_row(tmp_path):
    path = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"user_id": ["a", "b"], "text": pa.array([b"fine", b"caf\xe9"], pa.binary())}), path)
    msg = _read_error(_source(path))
    assert "bin.parquet" in msg and "row 2" in msg and "'text'" in msg and "UTF-8" in msg


def test_find_bad_utf8_across_chunk_boundary(tmp_path):
    path = tmp_path / "x"
    # A valid 2-byte character split across chunks, then a bad byte on line 2.
    path.write_bytes(b"ab\xc3\xa9cd\nx\xff")
    with open(path, "rb") as fh:
        assert find_bad_utf8(fh, chunk_bytes=3) == (8, 2)
    path.write_bytes(b"a\n\n\xc3\xa9\n\xc3\xa9\xff")  # newlines in earlier chunks counted once
    with open(path, "rb") as fh:
        assert find_bad_utf8(fh, chunk_bytes=2) == (8, 4)
    path.write_bytes("é\n".encode() * 10)
    with open(path, "rb") as fh:
        assert find_bad_utf8(fh, chunk_bytes=3) is None


def test_file_not_in_declared_format(tmp_path):
    csv_path = build_local(tmp_path / "d.csv", "csv")
    msg = _read_error(_source(csv_path, format="parquet"))
    assert "d.csv" in msg and "not a valid Parquet file" in msg
    msg = _read_error(_source(csv_path, format="jsonl"))
    assert "d.csv" in msg and "line 1 is not valid JSON" in msg
    pq_path = build_local(tmp_path / "d.parquet", "parquet")
    msg = _read_error(_source(pq_path, format="csv"))
    assert "d.parquet" in msg and "Parquet file, not csv" in msg


def test_malformed_csv_row(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("user_id,text\nu1,a\nu2,b,extra\n")
    msg = _read_error(_source(path))
    assert "m.csv" in msg and "not a valid CSV" in msg


def test_wrong_value_types(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"user_id": "u", "text": 3}\n')
    assert "line 1" in (msg := _read_error(_source(path))) and "'text' holds int64 values (3)" in msg
    path2 = tmp_path / "f.parquet"
    pq.write_table(pa.table({"user_id": [1.5], "text": ["x"]}), path2)
    assert "f.parquet" in (msg := _read_error(_source(path2))) and "user ids must be strings or integers" in msg


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\.mine\.format.*\.txt"):
        _source(tmp_path / "d.txt")
    with pytest.raises(ConfigError, match=r"datasets\.mine\.url.*allowed keys.*'user_column'"):
        _source(tmp_path / "d.csv", url="http://x")
    with pytest.raises(ConfigError, match=r"datasets\.mine\.path is required"):
        LocalSource("mine", {"source": "local"}, tmp_path)


def test_jsonl_with_integer_and_string_ids_is_refused(tmp_path):
    """7 and "7" would become one user and change the contribution counts silently: refused, naming both lines."""
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"user_id": 7, "text": "a"}\n{"user_id": 8, "text": "b"}\n{"user_id": "7", "text": "c"}\n')
    msg = _read_error(_source(path))
    assert "mixed.jsonl" in msg and "line 3" in msg and "line 1's is an integer" in msg and "one type" in msg
    one_type = tmp_path / "ints.jsonl"
    one_type.write_text('{"user_id": 7, "text": "a"}\n{"user_id": 8, "text": "b"}\n')
    assert [r[0] for r in _rows(_source(one_type))] == ["7", "8"]
