"""The interface every dataset source implements.

A source turns a dataset spec from the config into a stream of Arrow record
batches with (at least) the columns of `RAW_SCHEMA`:

- `user_id` (string): the privacy unit (an account, a news domain, an author).
- `text` (string): one example.
- `source_split` (string, nullable): the source's own split where it has one
  (Stack Overflow: train/heldout/test), else null.

Streams are bounded in memory: sources yield batches of at most `batch_rows`
rows and never hold a whole corpus as Python objects. Sources with a public
(pretraining) part also yield its texts from `iter_public`.

A dataset of ANY source may name its own public corpus with a `public` key
(`datasets.<name>.public`: a local file/folder or a streamed hub dataset, see
`userdp.data.public`). `open_source` then wraps the source so that
`has_public`/`iter_public` read that corpus; for `synthetic` and `fortunes`
it replaces their built-in public part. Build sources with `open_source`
(not the loader classes) so that this routing applies. Which sources
exist, their config keys and their built-in public parts are declared in
`userdp.data.sources`.

Errors in the input raise `userdp.errors.DataError` naming the file (and row
or column) and the fix.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import pyarrow as pa

RAW_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string()),
        pa.field("text", pa.string()),
        pa.field("source_split", pa.string()),
    ]
)

PUBLIC_SCHEMA = pa.schema([pa.field("text", pa.string())])


class Source(Protocol):
    name: str
    spec: dict

    def download(self) -> None:
        """Fetch remote files into the data dir (a no-op for local/embedded sources)."""

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        """Yield RAW_SCHEMA batches of the private (user) data."""

    def has_public(self) -> bool:
        """Whether this source has a public pretraining part."""

    def iter_public(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        """Yield PUBLIC_SCHEMA batches of public text (only if has_public())."""


class NoPublicPart:
    """The public part of a loader without a built-in one: none. A `public` key gives one (open_source wraps
    the source with userdp.data.public.WithPublicCorpus)."""

    def has_public(self) -> bool:
        return False

    def iter_public(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        return iter(())
