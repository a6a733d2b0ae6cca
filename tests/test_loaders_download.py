"""HTTP download with resume and checksum, and streaming lzma decompression."""

from __future__ import annotations

import hashlib
import lzma
import os

import pytest

from builders import serve_dir
from userdp.data.download import decompress_lzma, download
from userdp.errors import DataError

PAYLOAD = os.urandom(1 << 16) + b"tail"  # ~64 KB, several chunks at chunk_bytes=4096
SHA = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "srv"
    root.mkdir()
    (root / "f.bin").write_bytes(PAYLOAD)
    with serve_dir(root) as (base, state):
        yield base + "/f.bin", state


def test_download_verifies_checksum(served, tmp_path):
    url, state = served
    dest = download(url, tmp_path / "out" / "f.bin", SHA, chunk_bytes=4096)
    assert dest.read_bytes() == PAYLOAD
    assert not (tmp_path / "out" / "f.bin.part").exists()
    # A second call finds the finished file and does not fetch again.
    download(url, dest, SHA)
    assert len(state.requests) == 1


def test_resumes_a_partial_file_with_a_range_request(served, tmp_path):
    url, state = served
    dest = tmp_path / "f.bin"
    (tmp_path / "f.bin.part").write_bytes(PAYLOAD[:30000])
    download(url, dest, SHA, chunk_bytes=4096)
    assert dest.read_bytes() == PAYLOAD
    assert state.requests == [{"path": "/f.bin", "range": "bytes=30000-"}]


def test_dropped_connection_is_retried_and_resumed(served, tmp_path):
    url, state = served
    state.drop_after = 10000
    dest = download(url, tmp_path / "f.bin", SHA, chunk_bytes=4096, retry_wait_s=0)
    assert dest.read_bytes() == PAYLOAD
    assert [r["range"] for r in state.requests] == [None, "bytes=10000-"]


def test_server_ignoring_range_restarts_from_zero(served, tmp_path):
    url, state = served
    state.ignore_range = True
    (tmp_path / "f.bin.part").write_bytes(b"garbage that must not stay")
    dest = download(url, tmp_path / "f.bin", SHA, chunk_bytes=4096)
    assert dest.read_bytes() == PAYLOAD


def test_checksum_mismatch_leaves_nothing(served, tmp_path):
    url, _ = served
    with pytest.raises(DataError) as err:
        download(url, tmp_path / "f.bin", "0" * 64)
    msg = str(err.value)
    assert url in msg and "0" * 64 in msg and SHA in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["srv"]


def test_http_error_names_url(served, tmp_path):
    url, _ = served
    with pytest.raises(DataError, match=r"HTTP 404.*path"):
        download(url.replace("f.bin", "missing.bin"), tmp_path / "m.bin")
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("fmt", [lzma.FORMAT_ALONE, lzma.FORMAT_XZ])
def test_decompress_streams_in_chunks(tmp_path, fmt):
    data = os.urandom(5000) * 40  # 200 KB, compressible
    src = tmp_path / "x.lzma"
    src.write_bytes(lzma.compress(data, format=fmt))
    out = decompress_lzma(src, tmp_path / "x", chunk_bytes=1024)
    assert out.read_bytes() == data


def test_decompress_concatenated_xz_streams(tmp_path):
    src = tmp_path / "x.xz"
    src.write_bytes(lzma.compress(b"first ") + lzma.compress(b"second"))
    assert decompress_lzma(src, tmp_path / "x").read_bytes() == b"first second"


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_bad_lzma_raises_and_leaves_no_output(tmp_path, damage):
    blob = lzma.compress(os.urandom(20000), format=lzma.FORMAT_ALONE)
    src = tmp_path / "x.sqlite.lzma"
    src.write_bytes(b"not lzma at all" * 10 if damage == "corrupt" else blob[: len(blob) // 2])
    with pytest.raises(DataError, match="x.sqlite.lzma"):
        decompress_lzma(src, tmp_path / "x.sqlite", chunk_bytes=1024)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.sqlite.lzma"]
