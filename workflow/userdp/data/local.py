"""The user's own data: one Parquet, JSON Lines or CSV file.

Spec keys (`datasets.<name>.<key>`), defaults in brackets:

- `path` (required): the file.
- `format` [`auto`]: `parquet`, `jsonl` or `csv`; `auto` picks it from the
  extension (.parquet/.pq, .jsonl/.ndjson, .csv).
- `user_column` [`user_id`]: the column with the user id (the privacy unit).
  Strings or integers; integers are turned into their decimal text.
- `text_column` [`text`]: the column with one example's text.
- `group_column` [null]: a column with a label that is constant per user (a
  language, a region): the user's group in the cost-of-privacy table
  (userdp.evaluation.groups). Read only by `user_labels`; a user whose rows
  carry different labels (or no label) is an error naming the user.
- `max_examples` [null]: stop after this many rows.

Every file is streamed in batches: Parquet by row groups
(`ParquetFile.iter_batches`), CSV with pyarrow's streaming reader
(`pyarrow.csv.open_csv`, quoted newlines allowed), JSON Lines line by line
with the standard `json` module. (pyarrow's JSON reader fixes each column's
type from the first block, so numeric user ids followed by text ids fail, and
its errors carry no line number; line-by-line parsing gives exact lines.)

Bad input is a DataError naming the file, the row/line and column, and the
fix: a missing or empty file, missing columns (listing those that exist),
null or empty user ids, bytes that are not UTF-8 (with the byte offset), a
file that is not in the declared format, or no rows at all. Empty or null
texts are NOT errors: they are passed through and the prepare stage drops and
counts them.
"""

from __future__ import annotations

import codecs
import copy
import csv
import json
import logging
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ..errors import ConfigError, DataError
from ..io import streaming_parquet
from .base import RAW_SCHEMA
from .chat import Framing, check_example, to_text
from .sources import source_keys
from .spec_keys import check_keys, max_examples

log = logging.getLogger(__name__)

FORMATS = ("parquet", "jsonl", "csv")
EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}

# Row locator: batch-relative index -> "row 12" / "line 13" for messages.
Locate = Callable[[int], str]


def find_bad_utf8(path: Path, chunk_bytes: int = 1 << 20) -> tuple[int, int] | None:
    """(byte offset, 1-based line) of the first invalid UTF-8 byte of a file, or None."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(chunk_bytes)
            final = not chunk
            # exc.start counts from the decoder's buffered input: the incomplete
            # sequence left over from the previous chunk, then this chunk.
            pending = len(dec.getstate()[0])
            try:
                dec.decode(chunk, final=final)
            except UnicodeDecodeError as exc:
                bad = offset - pending + exc.start
                with open(path, "rb") as again:
                    line = again.read(bad).count(b"\n") + 1
                return bad, line
            if final:
                return None
            offset += len(chunk)


class LocalSource:
    """A local Parquet / JSON Lines / CSV file with user and text columns."""

    def __init__(self, name: str, spec: dict, data_dir: Path, seed: int = 0):
        check_keys(name, spec, source_keys("local"))
        self.name, self.spec, self.data_dir, self.seed = name, spec, Path(data_dir), seed
        if not spec.get("path"):
            raise ConfigError(f"datasets.{name}.path is required for source 'local': the Parquet/JSONL/CSV file.")
        self.path = Path(spec["path"]).expanduser()
        self.user_column = spec.get("user_column") or "user_id"
        self.framing = Framing.of_spec(name, spec)
        self.group_column = spec.get("group_column") or None
        if self.group_column is not None and not isinstance(self.group_column, str):
            raise ConfigError(f"datasets.{name}.group_column is {self.group_column!r}; it must be a column name "
                              "(a string) or null.")
        self.max_examples = max_examples(name, spec)
        fmt = spec.get("format") or "auto"
        if fmt == "auto":
            suffix = self.path.suffix.lower()
            if suffix not in EXTENSIONS:
                raise ConfigError(
                    f"datasets.{name}.format is auto but the extension of {self.path} ({suffix or 'none'}) is not "
                    f"one of {sorted(EXTENSIONS)}; set datasets.{name}.format to one of {list(FORMATS)}."
                )
            fmt = EXTENSIONS[suffix]
        if fmt not in FORMATS:
            raise ConfigError(f"datasets.{name}.format is {fmt!r}; allowed values: auto, {', '.join(FORMATS)}.")
        self.format = fmt

    @property
    def columns(self) -> tuple[str, ...]:
        """The example's columns: (text,), (messages,) or (prompt, completion)."""
        return self.framing.columns

    @property
    def text_column(self) -> str:
        """The first example column (the text's for text rows): the one messages name."""
        return self.framing.columns[0]

    # ---------------------------------------------------------------- helpers

    def _err(self, what: str) -> DataError:
        return DataError(f"{self.path} (datasets.{self.name}, format {self.format}): {what}")

    def _missing_columns(self, names: list[str]) -> DataError:
        missing = [c for c in (self.user_column, *self.columns) if c not in names]
        keys = " / ".join(self.framing.column_keys)
        return self._err(
            f"missing column(s) {missing}; the file has columns {names}. Rename the columns or set "
            f"datasets.{self.name}.user_column / {keys}."
        )

    def _check_file(self) -> None:
        if not self.path.exists():
            raise DataError(f"{self.path} (datasets.{self.name}.path) does not exist; fix the path.")
        if not self.path.is_file():
            raise DataError(f"{self.path} (datasets.{self.name}.path) is not a file; point it at one {self.format} file.")
        if self.path.stat().st_size == 0:
            raise self._err("the file is empty (0 bytes).")
        with open(self.path, "rb") as fh:
            head = fh.read(4)
        if head == b"PAR1" and self.format != "parquet":
            raise self._err(f"this is a Parquet file, not {self.format}; set datasets.{self.name}.format: parquet.")

    def _as_text(self, arr: pa.Array, column: str, locate: Locate) -> pa.Array:
        """A string array from string/large_string/binary (UTF-8 checked) columns."""
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
                    if value is None:
                        continue
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise self._err(
                            f"{locate(i)}, column '{column}': byte {exc.start} of the value is not UTF-8 "
                            f"({value[max(0, exc.start - 10):exc.start + 10]!r}); re-encode the file as UTF-8."
                        ) from exc
                raise
        raise self._err(f"column '{column}' holds {t}, not text; store it as strings.")

    def _check_users(self, users: pa.Array, locate: Locate) -> pa.Array:
        t = users.type
        if pa.types.is_integer(t):
            users = users.cast(pa.string())
        elif not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                  or pa.types.is_large_binary(t) or pa.types.is_dictionary(t) or pa.types.is_null(t)):
            raise self._err(f"column '{self.user_column}' holds {t}; user ids must be strings or integers.")
        else:
            users = self._as_text(users, self.user_column, locate)
        bad = pc.or_kleene(pc.is_null(users), pc.equal(pc.utf8_trim_whitespace(users), ""))
        bad = pc.fill_null(bad, False)
        n_bad = pc.sum(bad).as_py() or 0
        if n_bad:
            i = pc.index(bad, True).as_py()
            kind = "null" if users[i].as_py() is None else "empty"
            raise self._err(
                f"{locate(i)} has a {kind} user id in column '{self.user_column}' ({n_bad} such row(s) in "
                "this batch); every row needs a user id: fill it in or drop those rows."
            )
        return users

    def _examples(self, values: list[list], locate: Locate, json_cells: bool = False) -> pa.Array:
        """The stored text (`chat.to_text`) of chat or instruction examples, each checked; `values` holds the
        example columns' Python values. json_cells: a messages cell is JSON text (CSV)."""
        kind = self.framing.kind
        texts = []
        for i, row in enumerate(zip(*values)):
            where = f"{locate(i)}, column " + " / ".join(repr(c) for c in self.columns)
            if json_cells and kind == "messages" and isinstance(row[0], str):
                try:
                    row = (json.loads(row[0]),)
                except ValueError as exc:
                    raise self._err(f"{where} is not JSON text of a list of messages ({exc}); in CSV a "
                                    "conversation is written as its JSON.") from None
            try:
                texts.append(to_text(kind, check_example(kind, row, where)))
            except DataError as exc:
                raise self._err(str(exc)) from None
        return pa.array(texts, pa.string())

    def _batch_texts(self, batch: pa.RecordBatch | pa.Table, locate: Locate, json_cells: bool = False) -> pa.Array:
        """The text column of a batch that holds the example columns (`self.columns`)."""
        if self.framing.kind == "text":
            return batch.column(self.text_column)
        return self._examples([batch.column(c).to_pylist() for c in self.columns], locate, json_cells)

    def _raw(self, users: pa.Array, texts: pa.Array, locate: Locate) -> pa.RecordBatch:
        users = self._check_users(users, locate)
        texts = self._as_text(texts, self.text_column, locate)
        return pa.RecordBatch.from_arrays(
            [users, texts, pa.nulls(len(users), pa.string())], schema=RAW_SCHEMA
        )

    # ---------------------------------------------------------------- formats

    def _iter_parquet(self, batch_rows: int) -> Iterator[pa.RecordBatch]:
        try:
            pf = streaming_parquet(self.path, artifact=False)
        except (pa.ArrowInvalid, OSError) as exc:
            raise self._err(f"not a valid Parquet file ({exc}); check the file or set datasets.{self.name}.format.") from exc
        names = pf.schema_arrow.names
        if any(c not in names for c in (self.user_column, *self.columns)):
            raise self._missing_columns(names)
        row0 = 0
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=[self.user_column, *self.columns]):
                base = row0

                def locate(i: int, b: int = base) -> str:
                    return f"row {b + i + 1}"
                yield self._raw(batch.column(self.user_column), self._batch_texts(batch, locate), locate)
                row0 += batch.num_rows
        except pa.ArrowInvalid as exc:
            raise self._err(f"reading rows after row {row0} failed: {exc}") from exc

    def _iter_csv(self, batch_rows: int) -> Iterator[pa.RecordBatch]:
        cols = [self.user_column, *self.columns]
        try:
            reader = pacsv.open_csv(
                self.path,
                read_options=pacsv.ReadOptions(block_size=1 << 22),
                parse_options=pacsv.ParseOptions(newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(
                    include_columns=cols, column_types={c: pa.string() for c in cols}
                ),
            )
        except KeyError:  # ArrowKeyError: a column in include_columns is not in the header
            with open(self.path, encoding="utf-8", errors="replace", newline="") as fh:
                header = next(csv.reader(fh), [])
            raise self._missing_columns(header) from None
        except pa.ArrowInvalid as exc:
            raise self._csv_error(exc, 0) from exc
        row0 = 0
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as exc:
                raise self._csv_error(exc, row0) from exc
            for start in range(0, batch.num_rows, batch_rows):
                part = batch.slice(start, batch_rows)
                base = row0 + start

                def locate(i: int, b: int = base) -> str:
                    return f"row {b + i + 1} (not counting the header)"
                yield self._raw(part.column(self.user_column), self._batch_texts(part, locate, json_cells=True),
                                locate)
            row0 += batch.num_rows

    def _csv_error(self, exc: Exception, row0: int) -> DataError:
        msg = str(exc)
        if "UTF8" in msg or "utf8" in msg.lower():
            where = find_bad_utf8(self.path)
            if where is not None:
                offset, line = where
                return self._err(
                    f"line {line} (byte offset {offset}) is not UTF-8; re-encode the file as UTF-8 "
                    "(e.g. `iconv -f latin1 -t utf-8`)."
                )
        after = f" (after data row {row0})" if row0 else ""
        return self._err(f"not a valid CSV file{after}: {msg}")

    def _iter_jsonl(self, batch_rows: int) -> Iterator[pa.RecordBatch]:
        users: list = []
        texts: list = []
        lines: list[int] = []

        def flush() -> pa.RecordBatch:
            ls = list(lines)

            def locate(i: int) -> str:
                return f"line {ls[i]}"
            if self.framing.kind == "text":
                column = pa.array(texts, pa.string())
            else:
                column = self._examples([list(c) for c in zip(*texts)], locate)
            batch = self._raw(pa.array(users, pa.string()), column, locate)
            users.clear()
            texts.clear()
            lines.clear()
            return batch

        offset = 0
        seen_keys: list[str] | None = None
        id_kind: tuple[str, int] | None = None  # the first user id's type and its line
        with open(self.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                start, offset = offset, offset + len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise self._err(
                        f"line {lineno} (byte offset {start + exc.start}) is not UTF-8; re-encode the file as UTF-8."
                    ) from exc
                if not line.strip():
                    continue  # blank lines (e.g. a trailing one) carry no record
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise self._err(
                        f"line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}); the file must be "
                        "JSON Lines: one JSON object per line."
                    ) from exc
                if not isinstance(obj, dict):
                    raise self._err(f"line {lineno} holds a JSON {type(obj).__name__}, not an object; JSON Lines "
                                    "needs one object per line.")
                if seen_keys is None:
                    seen_keys = list(obj)
                    if any(c not in obj for c in (self.user_column, *self.columns)):
                        raise self._missing_columns(seen_keys)
                if self.user_column not in obj:
                    raise self._err(f"line {lineno} has no key '{self.user_column}' (keys: {list(obj)}).")
                user = obj[self.user_column]
                if user is not None and not isinstance(user, (int, str)) or isinstance(user, bool):
                    raise self._err(f"line {lineno}: '{self.user_column}' is {user!r}; user ids must be strings or integers.")
                if user is not None:
                    # one id type per file: 7 and "7" would become the same user, silently changing the
                    # contribution counts the guarantee rests on
                    kind = "an integer" if isinstance(user, int) else "a string"
                    if id_kind is None:
                        id_kind = (kind, lineno)
                    elif kind != id_kind[0]:
                        raise self._err(
                            f"line {lineno}: user id {user!r} is {kind}, but line {id_kind[1]}'s is {id_kind[0]}; "
                            f"mixed id types would merge users such as 7 and \"7\" into one. Write every "
                            f"'{self.user_column}' with one type (all strings, or all integers).")
                    user = str(user) if isinstance(user, int) else user
                if self.framing.kind == "text":
                    text = obj.get(self.text_column)
                    if text is not None and not isinstance(text, str):
                        raise self._err(f"line {lineno}: '{self.text_column}' is a {type(text).__name__}, not a "
                                        "string.")
                else:  # the example's values, checked and stored at flush
                    text = tuple(obj.get(c) for c in self.columns)
                users.append(user)
                texts.append(text)
                lines.append(lineno)
                if len(users) >= batch_rows:
                    yield flush()
        if users:
            yield flush()

    # ---------------------------------------------------------------- Source

    def download(self) -> None:
        """Nothing to fetch; checks that the file exists."""
        self._check_file()

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        self._check_file()
        reader = {"parquet": self._iter_parquet, "csv": self._iter_csv, "jsonl": self._iter_jsonl}[self.format]
        left = self.max_examples
        total = 0
        for batch in reader(batch_rows):
            if left is not None:
                batch = batch.slice(0, left)
                left -= batch.num_rows
            total += batch.num_rows
            if batch.num_rows:
                yield batch
            if left is not None and left <= 0:
                break
        if total == 0:
            raise self._err(
                "the file has no data rows; it needs at least one row with "
                f"'{self.user_column}' and " + " and ".join(f"'{c}'" for c in self.columns) + "."
            )
        log.info("%s: read %d rows from %s", self.name, total, self.path)

    def user_labels(self, batch_rows: int = 10_000) -> pa.Table | None:
        """Each user's label from `group_column` (kind "label"), or None without one.

        The rows are read as `iter_batches` reads them (same formats, checks and max_examples), with the group
        column in the text column's place. Raises DataError naming the file and the user when a user's rows
        carry two labels, and the row when a label is missing.
        """
        if self.group_column is None:
            return None
        view = copy.copy(self)
        view.framing = Framing.of(text_column=self.group_column)
        parts = []
        for batch in view.iter_batches(batch_rows):
            users, labels = batch.column(0), batch.column(1)
            missing = pc.or_kleene(pc.is_null(labels), pc.equal(labels, ""))
            if pc.any(missing).as_py():
                i = pc.index(missing, True).as_py()
                raise self._err(
                    f"user {users[i].as_py()!r} has a row without a label in group column '{self.group_column}' "
                    f"(datasets.{self.name}.group_column); give every row its user's label.")
            parts.append(pa.table({"user_id": users, "label": labels}))
        table = pa.concat_tables(parts).group_by(["user_id", "label"]).aggregate([])
        counts = table.group_by("user_id").aggregate([("label", "count")])
        bad = counts.filter(pc.greater(counts.column("label_count"), 1))
        if bad.num_rows:
            user = bad.column("user_id")[0].as_py()
            seen = sorted(table.filter(pc.equal(table.column("user_id"), user)).column("label").to_pylist())
            raise self._err(
                f"user {user!r} has rows with different labels {seen[:5]} in group column '{self.group_column}' "
                f"({bad.num_rows} such user(s)); datasets.{self.name}.group_column must be constant per user "
                "(a user's language or region). Fix the labels or drop the key.")
        table = table.sort_by("user_id")
        return pa.table({"user_id": table.column("user_id"),
                         "kind": pa.array(["label"] * table.num_rows, pa.string()),
                         "label": table.column("label")})

    def has_public(self) -> bool:
        # No built-in public part; a `public` key gives one (open_source wraps
        # this source with userdp.data.public.WithPublicCorpus).
        return False

    def iter_public(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        return iter(())


def make_local(name: str, spec: dict, data_dir: Path, seed: int = 0) -> LocalSource:
    return LocalSource(name, spec, data_dir, seed)
