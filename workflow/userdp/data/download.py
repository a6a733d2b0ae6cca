"""Downloads with resume and checksum, and streaming lzma decompression.

Big releases (the Stack Overflow SQLite is several GB) must survive a dropped
connection or a killed job:

- the download goes to `<dest>.part`, a stable name, so a rerun (or a retry
  after a dropped connection) resumes it with an HTTP `Range` request;
- the SHA-256 is computed over the whole file (including the resumed part);
  on a mismatch the partial file is deleted so the next run starts afresh;
- only a complete, verified file is renamed to `dest`, so `dest` existing
  means the download finished.

Decompression streams through `lzma.LZMADecompressor` in fixed-size chunks
into a temporary file that is renamed into place when complete.

Only the standard library (urllib) is used, so this works wherever Python does.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import lzma
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import DataError
from ..io import atomic_path, sha256_file

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


def _content_range_start(header: str | None) -> int | None:
    """Start offset of a `Content-Range: bytes START-END/TOTAL` header."""
    if not header or not header.startswith("bytes "):
        return None
    try:
        return int(header[6:].split("-", 1)[0])
    except ValueError:
        return None


def _fetch_once(url: str, part: Path, state: dict, timeout: float, chunk_bytes: int) -> None:
    """One HTTP request that appends to `part` from its current size.

    `state["hasher"]` must already hold the hash of the bytes in `part`; it is
    replaced when the server does not resume. Raises OSError/HTTPException on
    network trouble (the caller retries).
    """
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"User-Agent": "userdp"})
    if have:
        req.add_header("Range", f"bytes={have}-")
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:
            # Range not satisfiable: the part already holds the whole file.
            log.info("server reports %s complete at %d bytes", url, have)
            return
        raise
    with resp:
        status = resp.status
        mode = "ab"
        if have and status == 206 and _content_range_start(resp.headers.get("Content-Range")) == have:
            log.info("resuming %s at byte %d", url, have)
        elif have:
            # The server ignored the Range header: start again from byte 0.
            log.warning("server did not resume %s (HTTP %d); downloading from the start", url, status)
            mode = "wb"
            state["hasher"] = hashlib.sha256()
            have = 0
        hasher = state["hasher"]
        length = resp.headers.get("Content-Length")
        expected = int(length) if length is not None and length.isdigit() else None
        got = 0
        last_log = time.monotonic()
        with open(part, mode) as fh:
            while chunk := resp.read(chunk_bytes):
                fh.write(chunk)
                hasher.update(chunk)
                got += len(chunk)
                now = time.monotonic()
                if now - last_log > 10:
                    last_log = now
                    log.info("downloaded %.1f MB of %s", (have + got) / 1e6, url)
        if expected is not None and got < expected:
            # A dropped connection can end the body early without an exception.
            raise http.client.IncompleteRead(b"", expected - got)


def download(
    url: str,
    dest: str | os.PathLike,
    sha256: str | None = None,
    *,
    retries: int = 3,
    timeout: float = 60.0,
    chunk_bytes: int = CHUNK_BYTES,
    retry_wait_s: float = 2.0,
) -> Path:
    """Download `url` to `dest` with resume and an optional SHA-256 check.

    Returns `dest`. If `dest` already exists (a finished earlier download) it is
    kept, after checking `sha256` when given. Network errors are retried
    `retries` times, each retry resuming where the last stopped; if they
    persist, or on HTTP errors or a checksum mismatch, raises DataError naming
    the URL and file. A mismatch deletes the partial file.
    """
    dest = Path(dest)
    expected = sha256.lower() if sha256 else None
    if dest.exists():
        if expected and sha256_file(dest) != expected:
            raise DataError(
                f"{dest} exists but its SHA-256 does not match the configured sha256 {expected}; "
                f"delete the file to download it again from {url}, or fix the sha256."
            )
        log.info("%s already downloaded", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    state = {"hasher": hashlib.sha256()}
    if part.exists():  # resuming: the hash starts from the bytes already there
        with open(part, "rb") as fh:
            state["hasher"] = hashlib.file_digest(fh, "sha256")
    attempt = 0
    while True:
        try:
            _fetch_once(url, part, state, timeout, chunk_bytes)
            break
        except urllib.error.HTTPError as exc:
            raise DataError(
                f"downloading {url} to {dest} failed: HTTP {exc.code} {exc.reason}; check the URL "
                "(datasets.<name>.url) or set datasets.<name>.path to a local copy."
            ) from exc
        except (OSError, http.client.HTTPException, socket.timeout) as exc:
            attempt += 1
            if attempt > retries:
                raise DataError(
                    f"downloading {url} to {dest} failed after {retries} retries: {exc}. The partial "
                    f"file {part} is kept; rerun to resume, or set datasets.<name>.path to a local copy."
                ) from exc
            log.warning("download of %s interrupted (%s); retry %d/%d resumes", url, exc, attempt, retries)
            time.sleep(retry_wait_s)
    if not part.exists():
        part.touch()  # an empty body is a (tiny) file too
    got = state["hasher"].hexdigest()
    if expected and got != expected:
        part.unlink()
        raise DataError(
            f"the SHA-256 of {url} (saved as {dest}) is {got}, not the configured {expected}; the "
            "download was deleted. Check datasets.<name>.sha256 and the URL, then rerun."
        )
    if not expected:
        log.info("downloaded %s (sha256 %s; set sha256 in the config to pin it)", dest, got)
    os.replace(part, dest)
    return dest


def decompress_lzma(src: str | os.PathLike, dest: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Stream-decompress an .lzma/.xz file to `dest`, atomically.

    Memory stays at a few chunks whatever the file size. A corrupt or
    truncated file raises DataError naming it; nothing is left at `dest`.
    """
    src, dest = Path(src), Path(dest)
    written = 0
    try:
        with open(src, "rb") as fin, atomic_path(dest) as tmp, open(tmp, "wb") as fout:
            dec = lzma.LZMADecompressor(format=lzma.FORMAT_AUTO)
            while True:
                if dec.eof:
                    # Concatenated streams (allowed in .xz): start a new decompressor.
                    rest = dec.unused_data
                    if not rest:
                        rest = fin.read(chunk_bytes)
                        if not rest:
                            break
                    dec = lzma.LZMADecompressor(format=lzma.FORMAT_AUTO)
                    data = rest
                elif dec.needs_input:
                    data = fin.read(chunk_bytes)
                    if not data:
                        raise DataError(
                            f"{src} is truncated (the lzma stream ends early). If it is your own copy (datasets.<name>.path), "
                            "replace it with a complete one; if the pipeline downloaded it, delete it and rerun to "
                            "download it again."
                        )
                else:
                    data = b""
                out = dec.decompress(data, max_length=chunk_bytes)
                fout.write(out)
                written += len(out)
            fout.flush()
    except lzma.LZMAError as exc:
        raise DataError(f"{src} is not a valid lzma/xz file ({exc}). If it is your own copy (datasets.<name>.path), "
                         "replace it; if the pipeline downloaded it, delete it and rerun to download it again.") from exc
    log.info("decompressed %s to %s (%.1f MB)", src, dest, written / 1e6)
    return dest
