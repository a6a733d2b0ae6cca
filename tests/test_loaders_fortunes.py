"""Fortune-file loader: parsing rules on a built file, and the real package's counts."""

from __future__ import annotations

import collections

import pytest

from builders import build_fortune_file
from userdp.data.base import PUBLIC_SCHEMA, RAW_SCHEMA
from userdp.data.fortunes import FortunesSource, author_name, split_quote
from userdp.errors import ConfigError, DataError


def _source(path=None, **spec):
    spec = {"source": "fortunes", **({"path": str(path)} if path else {}), **spec}
    return FortunesSource("fortunes", spec, "unused")


def _private(src, batch_rows=2):
    batches = list(src.iter_batches(batch_rows))
    assert all(b.schema.equals(RAW_SCHEMA) and b.num_rows <= batch_rows for b in batches)
    return [(u, t) for b in batches for u, t in zip(b.column("user_id").to_pylist(), b.column("text").to_pylist())]


def _public(src, batch_rows=2):
    batches = list(src.iter_public(batch_rows))
    assert all(b.schema.equals(PUBLIC_SCHEMA) and b.num_rows <= batch_rows for b in batches)
    return [t for b in batches for t in b.column("text").to_pylist()]


QUOTES = [
    ("Never put off till tomorrow what you can do\nthe day after tomorrow.", 'Mark  Twain, "Notebook"'),
    ("An unattributed line.", None),
    ("Wit is educated insolence.", "Aristotle (Rhetoric)"),
    ("\tIndented\n\tpoem line two", "Mark Twain"),
    ("Who said this?", "Anonymous"),
    ("A wrapped attribution.", 'Dave Barry, "A Very Long\n\t\t   Title of a Column"'),
    ("%d is not a separator line", None),
]


def test_parses_authors_texts_and_public(tmp_path):
    path = build_fortune_file(tmp_path / "quotes", QUOTES)
    src = _source(path)
    assert src.has_public()
    assert _private(src) == [
        ("Mark Twain", "Never put off till tomorrow what you can do\nthe day after tomorrow."),
        ("Aristotle", "Wit is educated insolence."),
        ("Mark Twain", "Indented\npoem line two"),
        ("Dave Barry", "A wrapped attribution."),
    ]
    # Unattributed and placeholder-attributed quotes are public text, attribution stripped.
    assert _public(src) == ["An unattributed line.", "Who said this?", "%d is not a separator line"]


def test_folder_skips_indexes_and_offensive_set(tmp_path):
    build_fortune_file(tmp_path / "a", [("one", "X")])
    build_fortune_file(tmp_path / "b", [("two", "Y")])
    build_fortune_file(tmp_path / "b-o", [("bar", "Ebg")])  # rot13 set: skipped
    (tmp_path / "a.dat").write_bytes(b"\x00\x00\x00\x02binary index")
    assert _private(_source(tmp_path)) == [("X", "one"), ("Y", "two")]
    assert _private(_source(tmp_path, max_examples=1)) == [("X", "one")]


def test_split_quote_edge_cases():
    assert split_quote("\n\n") is None
    only = split_quote("\t\t-- Nobody in particular")  # an attribution alone stays text
    assert only is not None and only.author is None
    assert split_quote("text\n\t\t-- A, B\n\t\t   more\n\t\t   more").author == "A"
    assert split_quote("text\n-- not indented").author is None
    assert author_name("  Groucho   Marx  [attrib]") == "Groucho Marx"
    assert author_name("Unknown.") is None


def test_errors(tmp_path):
    with pytest.raises(DataError, match="nowhere"):
        list(_source(tmp_path / "nowhere").iter_batches())
    bad = tmp_path / "latin"
    bad.write_bytes(b"caf\xe9\n\t\t-- X\n%\n")
    with pytest.raises(DataError, match=r"latin: line 1 \(byte offset 3\)"):
        list(_source(bad).iter_batches())
    none = build_fortune_file(tmp_path / "none", [("just text", None)])
    with pytest.raises(DataError, match="no attributed quotes"):
        list(_source(none).iter_batches())
    with pytest.raises(ConfigError, match=r"datasets\.fortunes\.text_column"):
        _source(text_column="x")


def test_real_package_matches_documented_counts():
    """datasets.md: ~14,750 quotes, ~6,200 attributed, ~3,100 authors, largest ~118."""
    src = _source()
    counts = collections.Counter(u for u, _ in _private(src, batch_rows=4096))
    n_public = len(_public(src, batch_rows=4096))
    n_attr = sum(counts.values())
    assert 14_000 <= n_attr + n_public <= 15_500
    assert 5_800 <= n_attr <= 6_800
    assert 2_900 <= len(counts) <= 3_600
    assert 100 <= max(counts.values()) <= 130
    assert 2_200 <= sum(1 for c in counts.values() if c == 1) <= 2_700


def _norm(text):
    return " ".join(text.split())


def test_public_texts_never_repeat_attributed_texts(tmp_path):
    """A text that is also some user's (attributed) quote is private: it must not be public too.

    The public part feeds the tokenizer and non-private pretraining without
    noise, so an overlap would leak user data outside the DP guarantee.
    """
    quotes = [
        ("Shared wisdom,\n  said twice.", "Some Author"),
        ("Shared   wisdom, said twice.", None),      # same text after whitespace normalisation
        ("Truly public.", None),
        ("Also shared.", None),                      # public first, attributed later
        ("Also shared.\n", "Other Author"),
        ("Only private.", "Some Author"),
    ]
    src = _source(build_fortune_file(tmp_path / "overlap", quotes))
    assert _public(src) == ["Truly public."]
    assert sorted(t for _, t in _private(src)) == ["Also shared.", "Only private.", "Shared wisdom,\n  said twice."]
    # The packaged corpus has such overlaps (the same quote with and without
    # an attribution); after the fix none remain.
    real = _source()
    private = {_norm(t) for _, t in _private(real, batch_rows=4096)}
    public = [_norm(t) for t in _public(real, batch_rows=4096)]
    assert public and not private.intersection(public)
