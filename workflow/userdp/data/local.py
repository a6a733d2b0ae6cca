"""The user's own data: a Parquet, CSV, TSV or JSON Lines file (compressed or not), a folder of
Parquet files, or a folder written by `datasets.Dataset.save_to_disk`.

Spec keys (`datasets.<name>.<key>`), defaults in brackets:

- `path` (required): the file or folder.
- `format` [`auto`]: `parquet`, `csv`, `tsv`, `jsonl` or `save_to_disk`;
  `auto` picks it from the extension (.parquet/.pq, .csv, .tsv/.tab,
  .jsonl/.ndjson, each also as .gz/.bz2/.zst/.xz) or, for a folder, from
  its content.
- `separator` [null]: a CSV's separator; null = the one of `,` `;` tab `|`
  the header line holds most often (a tab for tsv).
- `user_column` [`user_id`]: the column with the user id (the privacy unit).
  Strings or integers; integers are turned into their decimal text.
- `text_column` [`text`]: the column with one example's text (or
  `messages_column`, or `prompt_column` + `completion_column`: chat and
  instruction rows, userdp.data.chat).
- `group_column` [null]: a column with a label that is constant per user (a
  language, a region): the user's group in the cost-of-privacy table
  (userdp.evaluation.groups). Read only by `user_labels`; a user whose rows
  carry different labels (or no label) is an error naming the user.
- `max_examples` [null]: stop after this many rows.

The file is read in batches by userdp.data.tables, the reader public corpora
share. Bad input is a DataError naming the file, the row/line and column,
and the fix: a missing or empty file, missing columns (listing those that
exist), null or empty user ids, bytes that are not UTF-8 (with the byte
offset), a file that is not in the declared format, or no rows at all. Empty
or null texts are NOT errors: they are passed through and the prepare stage
drops and counts them.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from ..errors import ConfigError, DataError
from .base import RAW_SCHEMA, NoPublicPart
from .chat import Framing, check_example, to_text
from .sources import source_keys
from .spec_keys import check_keys, max_examples
from .tables import Batch, Locate, TableFile

log = logging.getLogger(__name__)

#: the formats a local dataset reads (userdp.data.tables.FORMATS but one text per line)
FORMATS = ("parquet", "csv", "tsv", "jsonl", "save_to_disk")


class LocalSource(NoPublicPart):
    """A local data file (or folder) with user and example columns."""

    def __init__(self, name: str, spec: dict, data_dir: Path, seed: int = 0):
        check_keys(name, spec, source_keys("local"))
        self.name, self.spec, self.data_dir, self.seed = name, spec, Path(data_dir), seed
        if not spec.get("path"):
            raise ConfigError(f"datasets.{name}.path is required for source 'local': the data file (Parquet, CSV, "
                              "TSV, JSON Lines) or folder.")
        self.path = Path(spec["path"]).expanduser()
        self.user_column = spec.get("user_column") or "user_id"
        self.framing = Framing.of_spec(name, spec)
        self.group_column = spec.get("group_column") or None
        if self.group_column is not None and not isinstance(self.group_column, str):
            raise ConfigError(f"datasets.{name}.group_column is {self.group_column!r}; it must be a column name "
                              "(a string) or null.")
        self.max_examples = max_examples(name, spec)
        self.table = TableFile(self.path, f"datasets.{name}", spec.get("format"), spec.get("separator"), FORMATS)
        self.format = self.table.format

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
        return self.table.err(what)

    @property
    def _fix(self) -> str:
        """How to fix missing columns: the keys that name them."""
        return f"Rename the columns or set datasets.{self.name}.user_column / {' / '.join(self.framing.column_keys)}."

    def _check_users(self, users: pa.Array, locate: Locate) -> pa.Array:
        t = users.type
        if pa.types.is_integer(t):
            users = users.cast(pa.string())
        elif not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                  or pa.types.is_large_binary(t) or pa.types.is_dictionary(t) or pa.types.is_null(t)):
            i = users.is_valid().to_pylist().index(True)
            raise self._err(f"{locate(i)}, column '{self.user_column}' holds {t} values ({users[i].as_py()!r:.40}); "
                            "user ids must be strings or integers.")
        else:
            users = self.table.text(users, self.user_column, locate)
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
        example columns' Python values. json_cells: a messages cell is JSON text (CSV/TSV)."""
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

    def _raw(self, batch: Batch) -> pa.RecordBatch:
        """A RAW_SCHEMA batch (user id, text, no source split) of a batch of the user and example columns."""
        rows, locate = batch.table, batch.locate
        users = self._check_users(rows.column(self.user_column), locate)
        if self.framing.kind == "text":
            texts = self.table.text(rows.column(self.text_column), self.text_column, locate)
        else:
            texts = self._examples([rows.column(c).to_pylist() for c in self.columns], locate, batch.json_text)
        return pa.RecordBatch.from_arrays([users, texts, pa.nulls(len(users), pa.string())], schema=RAW_SCHEMA)

    # ---------------------------------------------------------------- Source

    def download(self) -> None:
        """Nothing to fetch; checks that the file exists."""
        self.table.check()

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        left = self.max_examples
        total = 0
        for part in self.table.batches([self.user_column, *self.columns], batch_rows, self._fix):
            batch = self._raw(part)
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
