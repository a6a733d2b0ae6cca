"""Stack Overflow (TFF SQLite) loader on fixtures in the release format."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from builders import SO_ROWS, build_tff_sqlite, lzma_compress, serve_dir
from userdp.data.base import RAW_SCHEMA
from userdp.data.stackoverflow import StackOverflowSource
from userdp.errors import ConfigError, DataError


def _source(tmp_path, **spec):
    return StackOverflowSource("so", {"source": "stackoverflow", **spec}, tmp_path / "data" / "so")


def _rows(source, batch_rows=3):
    batches = list(source.iter_batches(batch_rows))
    assert all(b.schema.equals(RAW_SCHEMA) for b in batches)
    assert all(b.num_rows <= batch_rows for b in batches)
    return [r for b in batches for r in zip(*(b.column(c).to_pylist() for c in RAW_SCHEMA.names))]


def _expected(splits):
    return [(c, t, s) for s, c, t in SO_ROWS if s in splits]


def test_reads_sqlite_in_pages_with_source_split(tmp_path):
    db = build_tff_sqlite(tmp_path / "so.sqlite")
    src = _source(tmp_path, path=str(db))
    # Default splits: train + heldout (test rows of train users are left out).
    assert _rows(src, batch_rows=2) == _expected({"train", "heldout"})
    every = _source(tmp_path, path=str(db), splits=["train", "heldout", "test"])
    assert _rows(every, batch_rows=4) == _expected({"train", "heldout", "test"})
    assert not (tmp_path / "data").exists()  # a local .sqlite is read in place


def test_heldout_users_are_disjoint_from_train(tmp_path):
    src = _source(tmp_path, path=str(build_tff_sqlite(tmp_path / "so.sqlite")))
    rows = _rows(src)
    train = {u for u, _, s in rows if s == "train"}
    heldout = {u for u, _, s in rows if s == "heldout"}
    assert heldout and train and not train & heldout


def test_title_and_max_examples(tmp_path):
    db = build_tff_sqlite(tmp_path / "so.sqlite")
    rows = _rows(_source(tmp_path, path=str(db), include_title=True, max_examples=3), batch_rows=2)
    assert len(rows) == 3
    assert rows[0][1] == "how do i sort a list ? i want to sort a list ."


def test_lzma_path_is_decompressed_into_data_dir(tmp_path):
    db = build_tff_sqlite(tmp_path / "build" / "so.sqlite")
    packed = lzma_compress(db, tmp_path / "stackoverflow.sqlite.lzma")
    src = _source(tmp_path, path=str(packed))
    src.download()
    assert src.sqlite_path() == tmp_path / "data" / "so" / "stackoverflow.sqlite"
    assert _rows(src) == _expected({"train", "heldout"})


def test_download_resumes_verifies_and_decompresses(tmp_path):
    db = build_tff_sqlite(tmp_path / "build" / "so.sqlite")
    srv = tmp_path / "srv"
    srv.mkdir()
    packed = lzma_compress(db, srv / "stackoverflow.sqlite.lzma")
    blob = packed.read_bytes()
    data_dir = tmp_path / "data" / "so"
    data_dir.mkdir(parents=True)
    (data_dir / "stackoverflow.sqlite.lzma.part").write_bytes(blob[:100])  # an interrupted earlier run
    with serve_dir(srv) as (base, state):
        src = _source(tmp_path, url=f"{base}/stackoverflow.sqlite.lzma", sha256=hashlib.sha256(blob).hexdigest())
        src.download()
        assert state.requests == [{"path": "/stackoverflow.sqlite.lzma", "range": "bytes=100-"}]
        assert (data_dir / "stackoverflow.sqlite.lzma").read_bytes() == blob
        assert _rows(src) == _expected({"train", "heldout"})
        src.download()  # done: no second request
        assert len(state.requests) == 1


def test_checksum_mismatch_is_an_error_and_leaves_nothing(tmp_path):
    db = build_tff_sqlite(tmp_path / "build" / "so.sqlite")
    srv = tmp_path / "srv"
    srv.mkdir()
    lzma_compress(db, srv / "stackoverflow.sqlite.lzma")
    with serve_dir(srv) as (base, _):
        src = _source(tmp_path, url=f"{base}/stackoverflow.sqlite.lzma", sha256="ab" * 32)
        with pytest.raises(DataError, match="stackoverflow.sqlite.lzma.*" + "ab" * 32):
            list(src.iter_batches())
    assert list((tmp_path / "data" / "so").iterdir()) == []


def test_not_sqlite_is_a_data_error(tmp_path):
    bad = tmp_path / "so.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(DataError, match=r"so\.sqlite.*not a readable SQLite"):
        list(_source(tmp_path, path=str(bad)).iter_batches())


def test_lzma_of_non_sqlite_leaves_no_output(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"plain text, no database" * 50)
    packed = lzma_compress(junk, tmp_path / "so.sqlite.lzma")
    src = _source(tmp_path, path=str(packed))
    with pytest.raises(DataError, match="so.sqlite"):
        src.download()
    assert list((tmp_path / "data" / "so").iterdir()) == []


def test_missing_table_is_a_data_error(tmp_path):
    db = build_tff_sqlite(tmp_path / "so.sqlite", with_metadata=False)
    with pytest.raises(DataError, match=r"so\.sqlite has no table 'client_metadata'"):
        list(_source(tmp_path, path=str(db)).iter_batches())
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE posts (body TEXT)")
    con.close()
    with pytest.raises(DataError, match=r"other\.sqlite has no table 'examples'.*posts"):
        _source(tmp_path, path=str(other)).download()


def test_bad_blob_names_the_row(tmp_path):
    rows = SO_ROWS[:2] + [("train", "00000009", b"\x0a\xff\xff\xff\xff\x0f")]
    db = build_tff_sqlite(tmp_path / "so.sqlite", rows)
    with pytest.raises(DataError, match=r"so\.sqlite: examples rowid 3"):
        list(_source(tmp_path, path=str(db)).iter_batches())


def test_spec_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\.so\.hub_name.*allowed keys.*'url'"):
        _source(tmp_path, hub_name="x")
    with pytest.raises(ConfigError, match=r"datasets\.so\.splits"):
        _source(tmp_path, splits=["validation"])
    with pytest.raises(ConfigError, match=r"datasets\.so\.max_examples"):
        _source(tmp_path, max_examples=0)


def test_interface(tmp_path):
    src = _source(tmp_path, path="x.sqlite")
    assert isinstance(src, StackOverflowSource)
    assert not src.has_public() and list(src.iter_public()) == []


def test_local_lzma_checksum_mismatch(tmp_path):
    packed = lzma_compress(build_tff_sqlite(tmp_path / "b" / "so.sqlite"), tmp_path / "so.sqlite.lzma")
    src = _source(tmp_path, path=str(packed), sha256="cd" * 32)
    with pytest.raises(DataError, match=r"so\.sqlite\.lzma: SHA-256 does not match datasets\.so\.sha256"):
        src.download()
    assert not src.sqlite_path().exists()


def test_registered_and_opened_through_open_source(tmp_path):
    from userdp.data.sources import open_source

    db = build_tff_sqlite(tmp_path / "so.sqlite")
    src = open_source("so", {"source": "stackoverflow", "path": str(db)}, tmp_path / "data")
    assert isinstance(src, StackOverflowSource) and src.data_dir == tmp_path / "data" / "so"


def test_expected_rows_from_client_metadata_gives_prepare_an_eta(tmp_path, caplog):
    import logging

    from userdp.data.prepare import prepare_dataset

    db = build_tff_sqlite(tmp_path / "so.sqlite")
    n_default = len(_expected({"train", "heldout"}))
    assert _source(tmp_path, path=str(db)).expected_rows() == n_default
    assert _source(tmp_path, path=str(db), splits=["test"]).expected_rows() == len(_expected({"test"}))
    assert _source(tmp_path, path=str(db), max_examples=3).expected_rows() == 3
    assert _source(tmp_path, url="http://127.0.0.1:9/none.sqlite.lzma").expected_rows() is None  # not downloaded
    with caplog.at_level(logging.INFO, logger="userdp.data.prepare"):
        prepare_dataset(_source(tmp_path, path=str(db)), "so", {"source": "stackoverflow"}, tmp_path / "out", seed=0)
    # The stage's progress knows the total (from client_metadata), hence a percentage and an ETA.
    assert any(f"so: rows read: {n_default}/{n_default} (100.0%)" in r.getMessage() and "ETA" in r.getMessage()
               for r in caplog.records)
