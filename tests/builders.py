"""Builders of small fixture files in the exact upstream formats, and a local HTTP server.

- Stack Overflow (TFF): a SQLite file with the release's tables and indexes,
  whose blobs are serialized tf.train.Example protos; optionally
  lzma-compressed like the release (`.sqlite.lzma`, legacy .lzma container).
- CC-News: Parquet with the hub's columns (title, text, domain, date,
  description, url, image_url), all strings.
- Local data: Parquet, JSON Lines, CSV with chosen column names.
- Fortune files: quotes separated by `%` lines, attributions as indented
  `-- Author` lines.
- `serve_dir`: http.server on 127.0.0.1 in a thread, with HTTP Range support,
  a request log, and an optional dropped connection, for download tests.
"""

from __future__ import annotations

import contextlib
import csv
import http.server
import io
import json
import lzma
import os
import sqlite3
import threading
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from userdp.data.tfexample import make_example

# ---------------------------------------------------------------- Stack Overflow


def so_example(
    tokens: str,
    title: str = "how do i sort a list ?",
    tags: str = "python|list",
    type_: str = "question",
    score: int = 1,
    creation_date: str = "2010-02-01 12:00:00.000 UTC",
) -> bytes:
    """A serialized tf.train.Example with the TFF Stack Overflow features."""
    return make_example(
        {"tokens": tokens, "title": title, "tags": tags, "type": type_, "score": score, "creation_date": creation_date}
    )


# (split, client_id, tokens): users 1-3 have train and test rows (shared users, split by
# date); users 10 and 20 (divisible by 10) are heldout only, as in the release.
SO_ROWS: list[tuple[str, str, str]] = [
    ("train", "00000001", "i want to sort a list ."),
    ("train", "00000001", "it fails with a type error ."),
    ("train", "00000002", "use sorted ( ) with a key ."),
    ("test", "00000001", "thanks , that worked ."),
    ("heldout", "00000010", "what is a closure ?"),
    ("train", "00000003", "you can use <URL> for that ."),
    ("heldout", "00000010", "a closure captures variables ."),
    ("test", "00000002", "the docs say otherwise ."),
    ("heldout", "00000020", "how to read a file in c ?"),
    ("train", "00000002", "numpy arrays are faster ."),
    ("test", "00000003", "see my answer below ."),
]


def build_tff_sqlite(
    path: str | os.PathLike,
    rows: Sequence[tuple[str, str, str | bytes]] = SO_ROWS,
    with_metadata: bool = True,
) -> Path:
    """Write a SQLite file in the TFF Stack Overflow schema.

    `rows` are (split_name, client_id, tokens-or-raw-blob); a str becomes a
    serialized Example via `so_example`, bytes are stored as given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.executescript(
        """
        CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,
                               serialized_example_proto BLOB NOT NULL);
        CREATE INDEX example_client_id ON examples (client_id);
        CREATE INDEX example_split_client_ids ON examples (split_name, client_id);
        """
    )
    con.executemany(
        "INSERT INTO examples VALUES (?, ?, ?)",
        [(s, c, so_example(t) if isinstance(t, str) else t) for s, c, t in rows],
    )
    if with_metadata:
        con.executescript(
            """
            CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL,
                                          num_examples INTEGER NOT NULL);
            CREATE INDEX client_metadata_split_name ON client_metadata (split_name);
            INSERT INTO client_metadata
              SELECT client_id, split_name, COUNT(*) FROM examples GROUP BY client_id, split_name;
            """
        )
    con.commit()
    con.close()
    return path


def lzma_compress(src: str | os.PathLike, dest: str | os.PathLike, fmt: int = lzma.FORMAT_ALONE) -> Path:
    """Compress `src` like the release (.lzma = the legacy lzma_alone container by default)."""
    dest = Path(dest)
    dest.write_bytes(lzma.compress(Path(src).read_bytes(), format=fmt))
    return dest


# ---------------------------------------------------------------- CC-News

CC_NEWS_COLUMNS = ("title", "text", "domain", "date", "description", "url", "image_url")


def cc_news_rows(n: int = 9, domains: Sequence[str] = ("bbc.co.uk", "cnn.com", "example.org")) -> list[dict]:
    return [
        {
            "title": f"Headline {i}",
            "text": f"Article {i} body text from {domains[i % len(domains)]}.",
            "domain": domains[i % len(domains)],
            "date": f"2017-01-{i + 1:02d} 00:00:00",
            "description": f"Summary {i}",
            "url": f"https://{domains[i % len(domains)]}/news/{i}",
            "image_url": f"https://{domains[i % len(domains)]}/img/{i}.jpg",
        }
        for i in range(n)
    ]


def build_cc_news_parquet(
    path: str | os.PathLike, rows: Sequence[dict] | None = None, columns: Sequence[str] = CC_NEWS_COLUMNS
) -> Path:
    """Parquet in the hub schema (all columns strings); `columns` may drop some for error tests."""
    rows = cc_news_rows() if rows is None else rows
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({c: pa.array([r.get(c) for r in rows], pa.string()) for c in columns})
    pq.write_table(table, path)
    return path


# ---------------------------------------------------------------- local files

LOCAL_ROWS: list[dict] = [
    {"user_id": "alice", "text": "hello world"},
    {"user_id": "bob", "text": "a line, with a comma"},
    {"user_id": "alice", "text": "two\nlines"},
    {"user_id": "carol", "text": ""},  # empty text: passed through, dropped downstream
    {"user_id": "bob", "text": 'a "quoted" word'},
    {"user_id": "dave", "text": "ünïcödé ✓"},
]


def build_local(
    path: str | os.PathLike,
    fmt: str,
    rows: Sequence[dict] = LOCAL_ROWS,
    rename: dict[str, str] | None = None,
    *,
    separator: str = ",",
    bom: bool = False,
    compression: str | None = None,
) -> Path:
    """Write `rows` as parquet/jsonl/csv/tsv or a `datasets` save_to_disk folder; `rename` maps default column
    names to others. CSV: `separator`, a UTF-8 byte-order mark first (`bom`, as spreadsheets write it);
    text formats: `compression` gzip/bz2/zstd/xz of the whole file (the name is the caller's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rename = rename or {}
    rows = [{rename.get(k, k): v for k, v in r.items()} for r in rows]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    if fmt == "save_to_disk":
        import datasets

        datasets.Dataset.from_list(list(rows)).save_to_disk(str(path))
        return path
    out = io.StringIO(newline="")
    if fmt == "jsonl":
        for r in rows:
            out.write(json.dumps(r, ensure_ascii=False) + "\n")
    elif fmt in ("csv", "tsv"):
        w = csv.DictWriter(out, fieldnames=columns, delimiter="\t" if fmt == "tsv" else separator)
        w.writeheader()
        w.writerows(rows)
    else:
        raise ValueError(fmt)
    data = ("\ufeff" if bom else "").encode() + out.getvalue().encode("utf-8")
    path.write_bytes(compress(data, compression))
    return path


def compress(data: bytes, compression: str | None) -> bytes:
    """`data` compressed with gzip, bz2, zstd or xz (None: as it is)."""
    import bz2
    import gzip

    if compression is None:
        return data
    if compression == "zstd":
        sink = pa.BufferOutputStream()
        with pa.output_stream(sink, compression="zstd") as fh:
            fh.write(data)
        return sink.getvalue().to_pybytes()
    return {"gzip": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[compression](data)


# ---------------------------------------------------------------- fortunes


def build_fortune_file(path: str | os.PathLike, quotes: Sequence[tuple[str, str | None]], header: bool = True) -> Path:
    """A fortune file; each quote is (text, attribution or None), attribution as '\\t\\t-- X'."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = []
    for text, attribution in quotes:
        body = text.rstrip("\n")
        if attribution is not None:
            body += "\n\t\t-- " + attribution
        parts.append(body + "\n")
    content = ("%% $FreeBSD$\n" if header else "") + "%\n".join(parts) + "%\n"
    path.write_text(content, encoding="utf-8")
    return path


# ---------------------------------------------------------------- HTTP server


class _State:
    def __init__(self, root: Path):
        self.root = root
        self.requests: list[dict] = []  # {"path", "range"} per request
        self.drop_after: int | None = None  # close the first response after this many body bytes
        self.ignore_range = False


def _handler(state: _State):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            state.requests.append({"path": self.path, "range": self.headers.get("Range")})
            f = state.root / self.path.lstrip("/")
            if not f.is_file():
                self.send_error(404)
                return
            data = f.read_bytes()
            start = 0
            rng = None if state.ignore_range else self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[6:-1])
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if state.drop_after is not None:
                cut, state.drop_after = state.drop_after, None
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextlib.contextmanager
def serve_dir(root: str | os.PathLike) -> Iterator[tuple[str, _State]]:
    """Serve `root` on 127.0.0.1 (random port); yields (base URL, state)."""
    state = _State(Path(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
