"""One reader for the data files users bring: a local dataset's rows and a public corpus.

`TableFile(path, key, format, separator)` reads, in record batches of the
requested columns:

- `parquet`: a .parquet/.pq file, or a folder of them (searched
  recursively, read in sorted path order), by row groups
  (`pyarrow.parquet.ParquetFile.iter_batches`).
- `csv` / `tsv`: pyarrow's streaming CSV reader (`pyarrow.csv.open_csv`,
  quoted newlines allowed, every requested column read as text). The
  separator is `separator` when given, a tab for `tsv`, else the one of
  `,` `;` tab `|` that the header line holds most often (a spreadsheet
  exported with `;` reads as it is). A UTF-8 byte-order mark is skipped.
- `jsonl`: one JSON object per line, parsed line by line with the standard
  `json` module: a value's line is known exactly, and one column holding
  two JSON types (user ids 7 and "7", which would merge two users) is an
  error naming both lines. (pyarrow's JSON reader fixes each column's type
  from the first block and reports no line.)
- `txt`: one text per line (public corpora only).
- `save_to_disk`: a folder written by `datasets.Dataset.save_to_disk`,
  read with `datasets.load_from_disk`.

A file compressed with gzip, bzip2, zstd or xz (`.gz`, `.bz2`, `.zst`,
`.xz`; found from the file's first bytes, the format from the extension
before it) is decompressed while it streams. `format: auto` picks the
format from the extension; `format_for` says which ones.

Every message starts with the file, the config key and the format
(`posts.csv (datasets.mine, format csv): ...`), names the row or line, and
says how to fix it. Both sources (userdp.data.local and userdp.data.public)
read through here, so their messages are the same.
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import io
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import pyarrow as pa

from ..errors import ConfigError, DataError
from ..io import streaming_parquet

#: the table formats, in the order messages list them
FORMATS = ("parquet", "csv", "tsv", "jsonl", "txt", "save_to_disk")
#: file extension -> format (after any compression extension)
EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
              ".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "txt"}
#: compression -> (file extension, first bytes of such a file)
COMPRESSIONS = {"gzip": (".gz", b"\x1f\x8b"), "bz2": (".bz2", b"BZh"), "zstd": (".zst", b"\x28\xb5\x2f\xfd"),
                "xz": (".xz", b"\xfd7zXZ\x00")}
#: separators the header line is searched for when a CSV's `separator` is not given, in tie order
SEPARATORS = (",", ";", "\t", "|")
#: files that mark a `datasets.Dataset.save_to_disk` folder
SAVED_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")

# Row locator: batch-relative index -> "row 12" / "line 13" for messages.
Locate = Callable[[int], str]


def compression_of(path: Path) -> str | None:
    """The compression of a file from its first bytes (gzip, bz2, zstd, xz), or None."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    return next((name for name, (_, magic) in COMPRESSIONS.items() if head.startswith(magic)), None)


def _strip_compression(path: Path) -> Path:
    exts = {ext for ext, _ in COMPRESSIONS.values()} | {".zstd"}
    return path.with_suffix("") if path.suffix.lower() in exts else path


def format_for(path: Path) -> str | None:
    """The format `format: auto` picks for `path` (an existing folder or a file name), or None when it cannot."""
    if path.is_dir():
        return "save_to_disk" if any((path / m).exists() for m in SAVED_MARKERS) else "parquet"
    return EXTENSIONS.get(_strip_compression(path).suffix.lower())


def open_binary(path: Path, compression: str | None) -> IO[bytes]:
    """The file's bytes, decompressed while read."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bz2":
        return bz2.open(path, "rb")
    if compression == "xz":
        return lzma.open(path, "rb")
    if compression == "zstd":
        return io.BufferedReader(pa.input_stream(str(path), compression="zstd"))
    return open(path, "rb")


def find_bad_utf8(fh: IO[bytes], chunk_bytes: int = 1 << 20) -> tuple[int, int] | None:
    """(byte offset, 1-based line) of the first invalid UTF-8 byte of a stream, or None."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0
    while True:
        chunk = fh.read(chunk_bytes)
        final = not chunk
        # exc.start counts from the decoder's buffered input: the incomplete
        # sequence left over from the previous chunk, then this chunk.
        pending = dec.getstate()[0]
        try:
            dec.decode(chunk, final=final)
        except UnicodeDecodeError as exc:
            # the pending bytes are an incomplete character: they hold no newline
            return offset - len(pending) + exc.start, lines + (pending + chunk)[:exc.start].count(b"\n") + 1
        if final:
            return None
        offset += len(chunk)
        lines += chunk.count(b"\n")


#: JSON value types as messages name them, bool before int (a bool is an int); any other value is "an object"
_JSON_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"))


def _json_kind(value: Any) -> str:
    return next((kind for t, kind in _JSON_KINDS if isinstance(value, t)), "an object")


_ARROW_TYPE = {"a boolean": pa.bool_(), "an integer": pa.int64(), "a number": pa.float64(), "a string": pa.string()}


@dataclass
class Batch:
    """Rows of the requested columns, how to name a row in messages, and whether structured cells (a
    conversation) arrive as JSON text (CSV/TSV: every cell is text)."""

    table: pa.RecordBatch
    locate: Locate
    json_text: bool = False


class TableFile:
    """A data file (or folder) named by config key `key`; see the module docstring."""

    def __init__(self, path: str | Path, key: str, format: str | None = "auto", separator: str | None = None,
                 formats: tuple[str, ...] = FORMATS):
        self.path = Path(path).expanduser()
        self.key = key
        fmt = format or "auto"
        if fmt != "auto" and fmt not in formats:
            raise ConfigError(f"{key}.format is {fmt!r}; allowed values: auto, {', '.join(formats)}.")
        if fmt == "auto":
            fmt = format_for(self.path) or "auto"
        if fmt == "auto" or fmt not in formats:
            exts = sorted(e for e, f in EXTENSIONS.items() if f in formats)
            zips = ", ".join(ext for ext, _ in COMPRESSIONS.values())
            suffix = "".join(self.path.suffixes[-2:]) or "none"
            raise ConfigError(
                f"{key}.format is auto but the extension of {self.path} ({suffix}) is not one of {exts} (each "
                f"also compressed: {zips}); rename the file or set {key}.format to one of {list(formats)}.")
        self.format = fmt
        if separator is not None and (not isinstance(separator, str) or len(separator) != 1 or separator in "\r\n\""):
            raise ConfigError(f"{key}.separator is {separator!r}; it must be one character such as ',' ';' or "
                              "'\\t' (a tab: write \"\\t\" in double quotes in YAML).")
        if separator is not None and fmt not in ("csv", "tsv"):
            raise ConfigError(f"{key}.separator is set but the format is {fmt}; it applies to csv and tsv only: "
                              "remove it.")
        self.separator = separator
        self.compression: str | None = None  # found by check()
        self._sep: str | None = None  # the CSV separator in use, found by _header()

    # ---------------------------------------------------------------- naming

    def err(self, what: str, path: Path | None = None) -> DataError:
        """A DataError naming the file (or `path`, one file of a folder), the key and the format."""
        return DataError(f"{path or self.path} ({self.key}, format {self.format}): {what}")

    def missing(self, wanted: list[str], names: list[str], fix: str, path: Path | None = None) -> DataError:
        """The error for columns `wanted` not all in the file's `names`; `fix` names the keys to set."""
        missing = [c for c in wanted if c not in names]
        hint = ""
        if self.format in ("csv", "tsv") and len(names) == 1:
            seps = [s for s in SEPARATORS if s in names[0] and s != self._sep]
            if seps:
                hint = (f" The header {names[0]!r} looks separated by {seps[0]!r}: set {self.key}.separator: "
                        f"{json.dumps(seps[0])}.")
        return self.err(f"missing column(s) {missing}; the file has columns {names}. {fix}{hint}", path)

    # ---------------------------------------------------------------- checks

    @property
    def path_key(self) -> str:
        return f"{self.key}.path"

    def check(self) -> None:
        """A DataError for a path that is not there, an empty file or a file in another format."""
        if not self.path.exists():
            raise DataError(f"{self.path} ({self.path_key}) does not exist; fix the path.")
        if self.path.is_dir():
            if self.format == "save_to_disk":
                return
            if self.format != "parquet":
                raise DataError(f"{self.path} ({self.path_key}) is a folder; point it at one {self.format} file, or "
                                "at a folder of Parquet files or one written by datasets' save_to_disk.")
            self._parquet_files()
            return
        if self.format == "save_to_disk":
            raise DataError(f"{self.path} ({self.path_key}) is a file, but format save_to_disk reads the folder "
                            "that datasets.Dataset.save_to_disk wrote; point the path at that folder.")
        if self.path.stat().st_size == 0:
            raise self.err("the file is empty (0 bytes).")
        with open(self.path, "rb") as fh:
            head = fh.read(4)
        self.compression = compression_of(self.path)
        if head == b"PAR1" and self.format != "parquet":
            raise self.err(f"this is a Parquet file, not {self.format}; set {self.key}.format: parquet.")
        if self.compression and self.format == "parquet":
            raise self.err(f"the file is {self.compression}-compressed; Parquet compresses its own columns, so "
                           "decompress the file and point the path at the .parquet file.")

    def _parquet_files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix.lower() in (".parquet", ".pq"))
        if not files:
            raise DataError(
                f"{self.path} ({self.path_key}) is a folder without .parquet files; point it at a folder of Parquet "
                "files, a folder written by datasets' save_to_disk, or one data file.")
        return files

    # ---------------------------------------------------------------- reading

    def batches(self, columns: list[str], batch_rows: int, fix: str) -> Iterator[Batch]:
        """Record batches of `columns` (at most `batch_rows` rows each); `fix` ends the missing-column error.

        For `txt` the one column is each line, named `columns[0]`.
        """
        self.check()
        reader = {"parquet": self._parquet, "csv": self._csv, "tsv": self._csv, "jsonl": self._jsonl,
                  "txt": self._txt, "save_to_disk": self._saved}[self.format]
        yield from reader(columns, batch_rows, fix)

    def _stream(self) -> IO[bytes]:
        return open_binary(self.path, self.compression)

    def _decompress_error(self, exc: Exception) -> DataError:
        return self.err(f"the {self.compression} stream is damaged ({type(exc).__name__}: {exc}); check the file "
                        "(for gzip: `gzip -t`).")

    def _parquet(self, columns: list[str], batch_rows: int, fix: str) -> Iterator[Batch]:
        files = self._parquet_files()
        for path in files:
            try:
                pf = streaming_parquet(path, artifact=False)
            except (OSError, pa.ArrowException) as exc:
                raise self.err(f"not a valid Parquet file ({exc}); check the file or set {self.key}.format.",
                               path) from exc
            names = pf.schema_arrow.names
            if any(c not in names for c in columns):
                raise self.missing(columns, names, fix, path)
            row0 = 0
            try:
                for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
                    yield Batch(batch, lambda i, b=row0: f"row {b + i + 1}")
                    row0 += batch.num_rows
            except (OSError, pa.ArrowException) as exc:
                raise self.err(f"reading rows after row {row0} failed: {exc}", path) from exc

    def _header(self) -> tuple[list[str], str]:
        """The CSV header's column names and the separator (given, tab for tsv, or found in the header)."""
        try:
            with self._stream() as raw, io.TextIOWrapper(raw, "utf-8-sig", errors="replace", newline="") as fh:
                first = fh.readline()
        except (OSError, EOFError, lzma.LZMAError) as exc:
            raise self._decompress_error(exc) from exc
        sep = self.separator or ("\t" if self.format == "tsv" else None)
        if sep is None:
            counts = [first.count(s) for s in SEPARATORS]
            sep = SEPARATORS[counts.index(max(counts))] if max(counts) else ","
        names = next(csv.reader([first], delimiter=sep), [])
        return names, sep

    def _csv(self, columns: list[str], batch_rows: int, fix: str) -> Iterator[Batch]:
        import pyarrow.csv as pacsv

        names, self._sep = self._header()
        if not any(n.strip() for n in names):
            raise self.err("the file has no header line; the first line must name the columns.")
        if any(c not in names for c in columns):
            raise self.missing(columns, names, fix)
        row0 = 0
        with self._stream() as raw:
            try:
                reader = pacsv.open_csv(
                    raw,
                    read_options=pacsv.ReadOptions(block_size=1 << 22),
                    parse_options=pacsv.ParseOptions(delimiter=self._sep, newlines_in_values=True),
                    convert_options=pacsv.ConvertOptions(include_columns=columns,
                                                         column_types={c: pa.string() for c in columns}),
                )
                for batch in reader:
                    for start in range(0, batch.num_rows, batch_rows):
                        base = row0 + start
                        yield Batch(batch.slice(start, batch_rows),
                                    lambda i, b=base: f"row {b + i + 1} (not counting the header)", json_text=True)
                    row0 += batch.num_rows
            except (EOFError, lzma.LZMAError) as exc:
                raise self._decompress_error(exc) from exc
            except (OSError, pa.ArrowException) as exc:
                raise self._csv_error(exc, row0) from exc

    def _csv_error(self, exc: Exception, row0: int) -> DataError:
        msg = str(exc)
        if "utf8" in msg.lower():
            with self._stream() as fh:
                where = find_bad_utf8(fh)
            if where is not None:
                offset, line = where
                return self.err(f"line {line} (byte offset {offset}) is not UTF-8; re-encode the file as UTF-8 "
                                "(e.g. `iconv -f latin1 -t utf-8`).")
        if self.compression and not isinstance(exc, pa.ArrowInvalid):
            return self._decompress_error(exc)
        after = f" (after data row {row0})" if row0 else ""
        return self.err(f"not a valid {self.format.upper()} file{after}: {msg}")

    def _lines(self) -> Iterator[tuple[int, str]]:
        """(1-based line number, line with its newline), UTF-8 checked, a byte-order mark skipped."""
        offset = 0
        try:
            with self._stream() as fh:
                for lineno, raw in enumerate(fh, 1):
                    start, offset = offset, offset + len(raw)
                    try:
                        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                    except UnicodeDecodeError as exc:
                        raise self.err(f"line {lineno} (byte offset {start + exc.start}) is not UTF-8; re-encode "
                                       "the file as UTF-8.") from exc
                    yield lineno, line
        except (EOFError, lzma.LZMAError, gzip.BadGzipFile, pa.ArrowException) as exc:
            raise self._decompress_error(exc) from exc
        except OSError as exc:
            if self.compression:
                raise self._decompress_error(exc) from exc
            raise

    def _txt(self, columns: list[str], batch_rows: int, fix: str) -> Iterator[Batch]:
        texts: list[str] = []
        first = 1
        for lineno, line in self._lines():
            texts.append(line.rstrip("\r\n"))  # an empty line is an empty text: dropped and counted downstream
            if len(texts) >= batch_rows:
                yield Batch(pa.record_batch([pa.array(texts, pa.string())], names=columns[:1]),
                            lambda i, b=first: f"line {b + i}")
                texts, first = [], lineno + 1
        if texts:
            yield Batch(pa.record_batch([pa.array(texts, pa.string())], names=columns[:1]),
                        lambda i, b=first: f"line {b + i}")

    def _jsonl(self, columns: list[str], batch_rows: int, fix: str) -> Iterator[Batch]:
        values: dict[str, list] = {c: [] for c in columns}
        lines: list[int] = []
        kinds: dict[str, tuple[str, int]] = {}  # column -> (the JSON type of its first non-null value, its line)
        seen_keys = False

        def flush() -> Batch:
            arrays = []
            for c in columns:
                kind = kinds.get(c, (None, 0))[0]
                try:
                    arrays.append(pa.array(values[c], _ARROW_TYPE.get(kind)))
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
                    raise self.err(f"column {c!r} between lines {lines[0]} and {lines[-1]}: its values do not "
                                   f"share one structure ({exc}); give every row the same shape.") from exc
                values[c] = []
            ls = list(lines)
            lines.clear()
            return Batch(pa.record_batch(arrays, names=columns), lambda i: f"line {ls[i]}")

        for lineno, line in self._lines():
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) carry no record
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise self.err(f"line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}); JSON Lines needs "
                               "one JSON object per line.") from exc
            if not isinstance(obj, dict):
                raise self.err(f"line {lineno} holds a JSON {type(obj).__name__}, not an object; JSON Lines needs "
                               "one object per line.")
            if not seen_keys:
                seen_keys = True
                if any(c not in obj for c in columns):
                    raise self.missing(columns, list(obj), fix)
            for c in columns:
                value = obj.get(c)
                if value is not None:
                    kind = _json_kind(value)
                    first = kinds.setdefault(c, (kind, lineno))
                    if kind != first[0]:
                        raise self.err(
                            f"line {lineno}: {c!r} is {kind} ({value!r:.40}), but line {first[1]}'s is {first[0]}; "
                            f"write every {c!r} with one type (mixed types in a user id column would merge users "
                            "such as 7 and \"7\" into one).")
                values[c].append(value)
            lines.append(lineno)
            if len(lines) >= batch_rows:
                yield flush()
        if lines:
            yield flush()

    def _saved(self, columns: list[str], batch_rows: int, fix: str) -> Iterator[Batch]:
        import datasets  # heavy import, only for this format

        try:
            ds = datasets.load_from_disk(str(self.path))
        except Exception as exc:  # datasets raises FileNotFoundError, JSON errors, pyarrow errors, ...
            raise self.err(f"not a folder written by datasets' save_to_disk ({type(exc).__name__}: {exc}); point "
                           f"the path at such a folder, or set {self.key}.format.") from exc
        if isinstance(ds, datasets.DatasetDict):
            splits = list(ds)
            raise self.err(f"this is a DatasetDict with splits {splits}; point {self.path_key} at one split's "
                           f"folder (e.g. {self.path / splits[0]}).")
        if any(c not in ds.column_names for c in columns):
            raise self.missing(columns, list(ds.column_names), fix)
        row0 = 0
        for table in ds.select_columns(columns).with_format("arrow").iter(batch_size=batch_rows):
            for batch in table.to_batches():
                yield Batch(batch, lambda i, b=row0: f"row {b + i + 1}")
                row0 += batch.num_rows

    def text(self, arr: pa.Array | pa.ChunkedArray, column: str, locate: Locate) -> pa.Array:
        """`as_text` with this file's messages."""
        return as_text(arr, column, locate, self.err)


def as_text(arr: pa.Array | pa.ChunkedArray, column: str, locate: Locate,
            err: Callable[[str], DataError]) -> pa.Array:
    """A string array from string/binary (UTF-8 checked) columns; another type is `err` naming a row."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.cast(t.value_type), t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t):
        return arr.cast(pa.string())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        try:
            return arr.cast(pa.string())
        except pa.ArrowInvalid:
            for i, value in enumerate(arr.to_pylist()):
                try:
                    value is None or value.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise err(f"{locate(i)}, column '{column}': byte {exc.start} of the value is not UTF-8 "
                              f"({value[max(0, exc.start - 10):exc.start + 10]!r}); re-encode the file as UTF-8."
                              ) from exc
            raise
    i = arr.is_valid().to_pylist().index(True) if arr.null_count < len(arr) else 0
    raise err(f"{locate(i)}, column '{column}' holds {t} values ({arr[i].as_py()!r:.40}), not text; store it as "
              "strings.")
