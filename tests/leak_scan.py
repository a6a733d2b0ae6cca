"""Scan a run's artifacts for exact statistics of the train users' example counts (docs/privacy.md).

`exact_statistics` computes, from the counts, every statistic a leak would
show: the total, the maximum, the medians and quantiles (both definitions
the project uses), the log2 histogram and the frequency table, and for every
G = 2, 4, ... up to the maximum the bounded pool N_G, mbar_G, and the
sampling rates and cohort sizes the planner would derive from them. Small
whole numbers (below `MIN_DISTINCTIVE_INT`) and values that equal a public
size are left out: they occur legitimately everywhere (steps, seeds, G).

`find_leaks` reads every file under a folder and reports each place one of
them occurs as a whole value:

* JSON: every number, and numbers inside strings;
* Parquet: every cell (numbers, lists, strings parsed as JSON or text);
* text (logs, CSV, HTML, SVG, reST, YAML): the numbers of the text, with
  thousands separators removed; a float printed with fewer than
  `TEXT_MIN_DIGITS` significant digits is not compared (too many chance
  matches with losses);
* PNG: its text chunks (metadata); PDF: the text of its (deflated) streams.

Sequences (histogram counts, users per distinct count) are matched as a
contiguous run of whole numbers inside any list or any text.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow.parquet as pq

MIN_DISTINCTIVE_INT = 100
TEXT_MIN_DIGITS = 5
FLOAT_RTOL = 1e-9
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:[eE][-+]?\d+)?|(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
BINARY_SUFFIXES = {".safetensors", ".pt", ".bin", ".pkl"}


@dataclass
class Targets:
    ints: dict[int, str] = field(default_factory=dict)
    floats: dict[float, str] = field(default_factory=dict)
    sequences: dict[tuple[int, ...], str] = field(default_factory=dict)


def _lower_quantile(sorted_counts: np.ndarray, p: float) -> int:
    """The project's quantile (privacy.contributions): smallest count with a share >= p of users at or below it."""
    k = max(0, math.ceil(p * sorted_counts.size - 1e-9 * sorted_counts.size) - 1)
    return int(sorted_counts[min(k, sorted_counts.size - 1)])


def exact_statistics(counts: Iterable[int], public: Iterable[float], budgets: Iterable[tuple[int, int]]) -> Targets:
    """Targets for the train users' counts; `public` are values allowed anywhere (N, K, T, ...)."""
    c = np.sort(np.asarray(list(counts), dtype=np.int64))
    n = c.size
    allowed = {float(v) for v in public}
    t = Targets()

    def add_int(v, name):
        v = int(v)
        if v >= MIN_DISTINCTIVE_INT and float(v) not in allowed:
            t.ints.setdefault(v, name)

    def add_float(v, name):
        v = float(v)
        if math.isfinite(v) and not v.is_integer() and v not in allowed:
            t.floats.setdefault(v, name)
        elif math.isfinite(v) and v.is_integer():
            add_int(v, name)

    add_int(c.sum(), "total examples of the train users")
    add_int(c[-1], "max count")
    add_float(np.median(c), "median (numpy)")
    add_float(c.mean(), "mean count")
    for p in QUANTILES:
        add_float(np.quantile(c, p), f"quantile {p:g} (numpy)")
        add_int(_lower_quantile(c, p), f"quantile {p:g} (lower)")
    G = 2
    while G <= c[-1]:
        if c[0] >= G:  # every user has >= G: N_G = N G, mbar_G = G are public
            G *= 2
            continue
        bounded = np.minimum(c, G)
        n_g, mbar = int(bounded.sum()), float(bounded.mean())
        add_int(n_g, f"N_G, G={G}")
        add_float(mbar, f"mbar_G, G={G}")
        for K, T in budgets:
            add_float(K / T / n_g, f"ELS q from exact N_G, G={G}, K={K}")
            add_float(K / (T * mbar), f"ULS cohort from exact mbar_G, G={G}, K={K}")
            add_float(K / (T * mbar) / n, f"ULS q_u from exact mbar_G, G={G}, K={K}")
        G *= 2
    edges = 2 ** np.arange(int(math.floor(math.log2(c[-1]))) + 2)
    hist, _ = np.histogram(c, bins=edges)
    nz = np.flatnonzero(hist)
    core = tuple(int(x) for x in hist[nz[0]: nz[-1] + 1])
    if len(core) >= 3:
        t.sequences[core] = "log2 histogram of the counts"
    _, per_count = np.unique(c, return_counts=True)
    if per_count.size >= 3:
        t.sequences[tuple(int(x) for x in per_count)] = "users per distinct count"
    return t


# ---------------------------------------------------------------- reading values


@dataclass
class Values:
    """What a file holds: numbers (value, exact?) and whole-number sequences."""

    numbers: list[tuple[float, int | None]] = field(default_factory=list)  # (value, significant digits or None)
    sequences: list[list[int]] = field(default_factory=list)


def _text_values(text: str, out: Values) -> None:
    run: list[int] = []
    for m in _NUMBER.finditer(text):
        s = m.group(0).replace(",", "")
        try:
            v = float(s)
        except ValueError:
            continue
        if not math.isfinite(v):  # e.g. "3e512" at the start of a hex digest: no count
            continue
        mantissa = re.sub(r"[eE].*$", "", s).lstrip("-")
        is_int = re.fullmatch(r"\d+", mantissa) is not None
        digits = len(mantissa.replace(".", "").lstrip("0")) or 1
        out.numbers.append((v, None if is_int else digits))
        # a whole number past int64 ("677e54" inside a hex digest) is no count either
        run.append(int(v) if is_int and abs(v) < 2 ** 63 else -1)
    out.sequences.append(run)


def _walk(obj, out: Values) -> None:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float, np.integer, np.floating)):
        out.numbers.append((float(obj), None))
    elif isinstance(obj, str):
        try:
            parsed = json.loads(obj)
        except (ValueError, TypeError):
            parsed = None
        if isinstance(parsed, (list, dict)):
            _walk(parsed, out)
        else:
            _text_values(obj, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(k, out)
            _walk(v, out)
    elif isinstance(obj, (list, tuple, np.ndarray)):
        items = list(obj)
        out.sequences.append([int(x) if isinstance(x, (int, np.integer)) and not isinstance(x, bool) else -1
                              for x in items])
        for x in items:
            _walk(x, out)


def _png_text(data: bytes) -> str:
    out, pos = [], 8
    while pos + 8 <= len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind in (b"tEXt", b"iTXt"):
            out.append(body.decode("latin-1"))
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out.append(key.decode("latin-1") + " " + zlib.decompress(rest[1:]).decode("latin-1"))
        pos += 12 + length
    return "\n".join(out)


def _pdf_text(data: bytes) -> str:
    """The text a PDF shows: the strings of its text operators ((..) Tj, [(..) kern (..)] TJ), one per line.

    Only text: page geometry, font programs and the cross-reference table are numbers that mean nothing.
    """
    lines = []
    for m in re.finditer(rb"stream\r?\n(.*?)endstream", data, re.S):
        try:
            stream = zlib.decompressobj().decompress(m.group(1)).decode("latin-1")
        except zlib.error:
            stream = m.group(1).decode("latin-1")
        for op in re.finditer(r"\[((?:\\.|[^\]])*)\]\s*TJ|\(((?:\\.|[^\\)])*)\)\s*Tj", stream):
            body = op.group(1) if op.group(1) is not None else f"({op.group(2)})"
            lines.append("".join(re.findall(r"\(((?:\\.|[^\\)])*)\)", body)).replace("\\", ""))
    return "\n".join(lines)


def file_values(path: Path) -> Values:
    out = Values()
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            _walk(json.loads(path.read_text()), out)
        except ValueError:
            _text_values(path.read_text(errors="replace"), out)
    elif suffix == ".parquet":
        table = pq.read_table(path)
        for name in table.column_names:
            _text_values(name, out)
            _walk(table.column(name).to_pylist(), out)
        meta = table.schema.metadata or {}
        for k, v in meta.items():
            _text_values(k.decode("utf-8", "replace") + " " + v.decode("utf-8", "replace"), out)
    elif suffix == ".png":
        _text_values(_png_text(path.read_bytes()), out)
    elif suffix == ".pdf":
        _text_values(_pdf_text(path.read_bytes()), out)
    else:
        _text_values(path.read_bytes().decode("utf-8", "replace"), out)
    return out


# ---------------------------------------------------------------- matching


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    a, n = np.asarray(seq, dtype=np.int64), len(sub)
    starts = np.flatnonzero(a[: a.size - n + 1] == sub[0])
    return any(tuple(a[i:i + n].tolist()) == sub for i in starts)


def leaks_in(values: Values, targets: Targets) -> list[str]:
    found = []
    exact = np.array([v for v, d in values.numbers if d is None], dtype=float)
    whole = exact[np.isfinite(exact) & (np.abs(exact) < 2.0**62)]
    for v in set(whole[whole == np.round(whole)].astype(np.int64).tolist()) & set(targets.ints):
        found.append(f"{targets.ints[v]} = {v}")
    for t, name in targets.floats.items():
        if exact.size and np.any(np.abs(exact - t) <= FLOAT_RTOL * abs(t)):
            found.append(f"{name} = {t!r}")
    for v, digits in values.numbers:
        if digits is not None and digits >= TEXT_MIN_DIGITS:
            for t, name in targets.floats.items():
                if float(f"{t:.{digits}g}") == v:
                    found.append(f"{name} = {t!r} (printed {v!r})")
    for seq in values.sequences:
        for sub, name in targets.sequences.items():
            if len(seq) >= len(sub) and _contains(seq, sub):
                found.append(f"{name} = {list(sub)}")
    return sorted(set(found))


def artifact_files(root: Path, exclude: Iterable[Path] = ()) -> Iterator[Path]:
    skip = {Path(p).resolve() for p in exclude}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.resolve() not in skip and path.suffix.lower() not in BINARY_SUFFIXES:
            yield path


def find_leaks(root: Path, targets: Targets, exclude: Iterable[Path] = ()) -> dict[str, list[str]]:
    """{file relative to root: the statistics it holds} for every file under root but `exclude`."""
    out = {}
    for path in artifact_files(root, exclude):
        hits = leaks_in(file_values(path), targets)
        if hits:
            out[str(path.relative_to(root))] = hits
    return out
