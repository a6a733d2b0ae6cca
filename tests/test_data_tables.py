"""The one table reader (userdp.data.tables) as both sources use it: every file kind and its errors."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from builders import LOCAL_ROWS, build_local, compress
from test_data_public import data_workflow
from userdp.data.local import LocalSource
from userdp.data.public import PublicCorpus
from userdp.data.tables import TableFile, compression_of, format_for
from userdp.errors import ConfigError, DataError

EXPECTED = [(r["user_id"], r["text"]) for r in LOCAL_ROWS]
COMPRESSIONS = {"gzip": ".gz", "bz2": ".bz2", "zstd": ".zst", "xz": ".xz"}


def _local(path, **spec):
    return LocalSource("mine", {"source": "local", "path": str(path), **spec}, path.parent / "data")


def _rows(source, batch_rows=4):
    return [(u, t) for b in source.iter_batches(batch_rows) for u, t in zip(b.column(0).to_pylist(),
                                                                            b.column(1).to_pylist())]


def _error(source, kind=DataError) -> str:
    with pytest.raises(kind) as err:
        list(source.iter_batches(2))
    return str(err.value)


@pytest.mark.parametrize("compression", [None, *COMPRESSIONS])
@pytest.mark.parametrize("fmt,ext", [("csv", ".csv"), ("tsv", ".tsv"), ("jsonl", ".jsonl")])
def test_text_formats_plain_and_compressed(tmp_path, fmt, ext, compression):
    path = build_local(tmp_path / f"posts{ext}{COMPRESSIONS.get(compression, '')}", fmt, compression=compression)
    assert compression_of(path) == compression and format_for(path) == fmt
    source = _local(path)
    assert source.format == fmt and _rows(source) == EXPECTED


def test_compression_found_from_the_bytes_not_the_name(tmp_path):
    """A gzip file without .gz still reads; `format` names the table format."""
    path = build_local(tmp_path / "export.data", "jsonl", compression="gzip")
    assert _rows(_local(path, format="jsonl")) == EXPECTED


def test_excel_csv_with_bom_and_semicolons(tmp_path):
    """The issue's case: a spreadsheet export, header `\\ufeffauthor;message`."""
    path = build_local(tmp_path / "commits.csv", "csv", rename={"user_id": "author", "text": "message"},
                       separator=";", bom=True)
    assert path.read_bytes().startswith(b"\xef\xbb\xbfauthor;message")
    assert _rows(_local(path, user_column="author", text_column="message")) == EXPECTED


def test_separator_key_and_its_hint(tmp_path):
    path = build_local(tmp_path / "p.csv", "csv", separator="|")
    assert _rows(_local(path, separator="|")) == EXPECTED
    assert _rows(_local(path)) == EXPECTED  # found in the header
    msg = _error(_local(path, separator=","))
    assert "p.csv (datasets.mine, format csv): missing column(s) ['user_id', 'text']" in msg
    assert "looks separated by '|': set datasets.mine.separator: \"|\"" in msg
    tsv = build_local(tmp_path / "p.tab", "tsv")
    assert _local(tsv).format == "tsv" and _rows(_local(tsv)) == EXPECTED


@pytest.mark.parametrize("separator,fmt,pattern", [
    (";;", "csv", r"datasets\.mine\.separator is ';;'; it must be one character"),
    ("\n", "csv", r"datasets\.mine\.separator is '\\n'"),
    (",", "jsonl", r"datasets\.mine\.separator is set but the format is jsonl"),
])
def test_bad_separator_is_a_config_error(tmp_path, separator, fmt, pattern):
    path = build_local(tmp_path / f"p.{fmt}", fmt)
    with pytest.raises(ConfigError, match=pattern):
        _local(path, separator=separator)


def test_save_to_disk_folder(tmp_path):
    path = build_local(tmp_path / "saved", "save_to_disk")
    assert format_for(path) == "save_to_disk"
    source = _local(path)
    source.download()
    assert source.format == "save_to_disk" and _rows(source, batch_rows=4) == EXPECTED
    assert _rows(_local(path, max_examples=3)) == EXPECTED[:3]
    msg = _error(_local(path, text_column="body"))
    assert "saved (datasets.mine, format save_to_disk): missing column(s) ['body']" in msg
    assert "the file has columns ['user_id', 'text']" in msg


def test_save_to_disk_dataset_dict_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(LOCAL_ROWS),
                          "test": datasets.Dataset.from_list(LOCAL_ROWS[:2])}).save_to_disk(str(tmp_path / "dd"))
    msg = _error(_local(tmp_path / "dd", format="save_to_disk"))
    assert "a DatasetDict with splits ['train', 'test']" in msg and f"{tmp_path / 'dd' / 'train'}" in msg
    assert _rows(_local(tmp_path / "dd" / "train")) == EXPECTED


def test_folder_of_parquet_files_for_a_local_dataset(tmp_path):
    (tmp_path / "parts" / "b").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(LOCAL_ROWS[3:]), tmp_path / "parts" / "b" / "2.parquet")
    pq.write_table(pa.Table.from_pylist(LOCAL_ROWS[:3]), tmp_path / "parts" / "a.parquet")
    assert _rows(_local(tmp_path / "parts")) == EXPECTED  # sorted path order: a.parquet, then b/2.parquet


def test_folder_errors(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("x")
    assert "is a folder without .parquet files" in _error(_local(tmp_path / "notes"))
    msg = _error(_local(tmp_path / "notes", format="csv"))
    assert "notes (datasets.mine.path) is a folder; point it at one csv file" in msg
    path = build_local(tmp_path / "p.csv", "csv")
    assert "format save_to_disk reads the folder" in _error(_local(path, format="save_to_disk"))


def test_damaged_and_misnamed_compressed_files(tmp_path):
    whole = compress(build_local(tmp_path / "p.jsonl", "jsonl").read_bytes(), "gzip")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    msg = _error(_local(cut))
    assert "cut.jsonl.gz (datasets.mine, format jsonl): the gzip stream is damaged" in msg
    cut_csv = tmp_path / "cut.csv.xz"
    xz = compress(build_local(tmp_path / "p.csv", "csv").read_bytes(), "xz")
    cut_csv.write_bytes(xz[: len(xz) - 20])
    assert "the xz stream is damaged" in _error(_local(cut_csv))
    pq.write_table(pa.Table.from_pylist(LOCAL_ROWS), tmp_path / "p.parquet")
    gz = tmp_path / "p.parquet.gz"
    gz.write_bytes(compress((tmp_path / "p.parquet").read_bytes(), "gzip"))
    assert "Parquet compresses its own columns, so decompress the file" in _error(_local(gz))


def test_non_utf8_in_a_compressed_csv_names_the_decompressed_line(tmp_path):
    bad = b"\xe9"  # latin-1 e-acute: not UTF-8
    content = "user_id,text\nu,fine\nv,caf".encode() + bad + b"\n"
    path = tmp_path / "latin.csv.gz"
    path.write_bytes(compress(content, "gzip"))
    msg = _error(_local(path))
    assert "latin.csv.gz" in msg and "line 3" in msg and f"byte offset {content.index(bad)}" in msg


def test_unknown_extension_lists_the_formats(tmp_path):
    path = tmp_path / "posts.xlsx"
    path.write_bytes(b"x")
    with pytest.raises(ConfigError) as err:
        _local(path)
    msg = str(err.value)
    assert "datasets.mine.format is auto but the extension of" in msg and "(.xlsx)" in msg
    assert "'.tsv'" in msg and ".gz, .bz2, .zst, .xz" in msg and "'.txt'" not in msg  # no .txt for local data
    with pytest.raises(ConfigError, match=r"datasets\.mine\.format is 'txt'; allowed values: auto, parquet, csv"):
        _local(tmp_path / "p.txt", format="txt")


def test_jsonl_columns_with_two_types_name_both_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"user_id": "a", "text": "x"}\n{"user_id": "b", "text": ["y"]}\n')
    msg = _error(_local(path))
    assert "line 2: 'text' is a list (['y']), but line 1's is a string" in msg


def test_public_corpus_reads_every_kind(tmp_path):
    texts = [r["text"] for r in LOCAL_ROWS]
    kinds = {
        "c4.jsonl.gz": dict(fmt="jsonl", compression="gzip"),
        "c4.tsv": dict(fmt="tsv"),
        "c4.csv.zst": dict(fmt="csv", separator=";", bom=True, compression="zstd"),
        "c4_saved": dict(fmt="save_to_disk"),
    }
    for name, kw in kinds.items():
        path = build_local(tmp_path / name, kw.pop("fmt"), **kw)
        corpus = PublicCorpus("so", {"path": str(path)}, tmp_path / "data")
        got = [t for b in corpus.iter_batches(4) for t in b.column(0).to_pylist()]
        assert got == texts, name
    lines = tmp_path / "c4.txt.bz2"
    lines.write_bytes(compress("\ufeffone\ntwo\n".encode(), "bz2"))
    corpus = PublicCorpus("so", {"path": str(lines)}, tmp_path / "data")
    assert [t for b in corpus.iter_batches() for t in b.column(0).to_pylist()] == ["one", "two"]
    with pytest.raises(ConfigError, match=r"datasets\.so\.public\.separator is only used with datasets\.so\.public"
                                          r"\.path"):
        PublicCorpus("so", {"hub_name": "allenai/c4", "separator": ";"}, tmp_path / "data")


def test_both_sources_word_a_missing_column_alike(tmp_path):
    path = build_local(tmp_path / "p.csv", "csv", rename={"text": "body"})
    local = _error(_local(path))
    public = str(pytest.raises(DataError, lambda: list(PublicCorpus("mine", {"path": str(path)}, tmp_path)
                                                       .iter_batches())).value)
    prefix = f"{path} (datasets.mine, format csv): missing column(s) ['text']; the file has columns ['user_id', 'body']."
    assert local.startswith(prefix)
    assert public.startswith(prefix.replace("datasets.mine,", "datasets.mine.public,"))


def test_table_file_batches_are_bounded(tmp_path):
    rows = [{"user_id": f"u{i}", "text": f"t{i}"} for i in range(25)]
    for fmt, ext in [("csv", ".csv"), ("jsonl", ".jsonl"), ("parquet", ".parquet"), ("save_to_disk", "")]:
        path = build_local(tmp_path / f"many{ext or '_saved'}", fmt, rows)
        table = TableFile(path, "datasets.x")
        sizes = [b.table.num_rows for b in table.batches(["text"], 10, "")]
        assert sum(sizes) == 25 and max(sizes) <= 10, fmt
        first = next(iter(table.batches(["text"], 10, "")))
        assert first.table.column_names == ["text"] and first.locate(0) in ("row 1", "line 1",
                                                                            "row 1 (not counting the header)")


@pytest.mark.integration
def test_snakemake_prepares_a_dataset_of_every_new_kind(tmp_path):
    """The issue's four files on a real run of the data rules: .jsonl.gz, .tsv, a BOM + `;` CSV, save_to_disk."""
    wd = data_workflow(tmp_path)
    rows = [{"user_id": f"u{i % 5}", "text": f"note {i}; about, things"} for i in range(30)]
    files = {
        "gz": build_local(tmp_path / "posts.jsonl.gz", "jsonl", rows, compression="gzip"),
        "tsv": build_local(tmp_path / "posts.tsv", "tsv", rows),
        "excel": build_local(tmp_path / "posts.csv", "csv", rows, separator=";", bom=True),
        "saved": build_local(tmp_path / "saved", "save_to_disk", rows),
    }
    datasets = "".join(f"  {name}: {{source: local, path: {path}}}\n" for name, path in files.items())
    (wd / "config" / "config.yaml").write_text(
        f"seed: 0\ndatasets:\n{datasets}tokenizer: {{vocab_size: 300, sequence_length: 16}}\n"
        "grid: {datasets: [gz], methods: [els], epsilons: [1], budgets: [{compute: 100, steps: 2}]}\n")
    targets = [f"results/data/{name}/examples.parquet" for name in files]
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *targets], cwd=wd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = sorted((r["user_id"], r["text"]) for r in rows)
    for name in files:
        table = pq.read_table(wd / "results" / "data" / name / "examples.parquet", columns=["user_id", "text"])
        assert sorted(zip(*(table.column(c).to_pylist() for c in ("user_id", "text")))) == expected, name
