"""A user-named public (pretraining) corpus: `datasets.<name>.public` (userdp.data.public).

Every format is read from small files built here; the hub route runs the real
`datasets.load_dataset(..., streaming=True)` code path with `load_dataset`
pointed at a local Parquet file (no network), and one real snakemake run
checks that a `local` dataset with a `public` key gets a public.parquet that
`tokenizer.public_dataset` trains the tokenizer on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from builders import build_fortune_file, build_local
from userdp.data.base import PUBLIC_SCHEMA
from userdp.data.sources import open_source
from userdp.data.prepare import write_public
from userdp.data.sources import has_public_part
from userdp.data.public import PublicCorpus, WithPublicCorpus
from userdp.data.tokenize import public_dataset_name
from userdp.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]

TEXTS = ["the first public text", "", "zwei, mit komma", 'a "quoted" one', "ünïcödé ✓", "six"]


def _rows(texts=TEXTS, column="text"):
    return [{"url": f"https://example.org/{i}", column: t} for i, t in enumerate(texts)]


def _texts(corpus_or_source, batch_rows=4) -> list:
    it = corpus_or_source.iter_public(batch_rows) if hasattr(corpus_or_source, "iter_public") \
        else corpus_or_source.iter_batches(batch_rows)
    batches = list(it)
    assert all(b.schema.equals(PUBLIC_SCHEMA) and 0 < b.num_rows <= batch_rows for b in batches)
    return [t for b in batches for t in b.column("text").to_pylist()]


def _corpus(tmp_path, **public) -> PublicCorpus:
    return PublicCorpus("so", public, tmp_path / "data" / "so")


def _local_dataset(tmp_path) -> dict:
    path = build_local(tmp_path / "private.parquet", "parquet")
    return {"source": "local", "path": str(path)}


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt,ext", [("parquet", "parquet"), ("jsonl", "jsonl"), ("csv", "csv")])
def test_each_table_format_in_batches(tmp_path, fmt, ext):
    path = build_local(tmp_path / f"c4.{ext}", fmt, _rows())
    assert _texts(_corpus(tmp_path, path=str(path))) == TEXTS


def test_txt_one_text_per_line_and_custom_column_ignored(tmp_path):
    path = tmp_path / "c4.txt"
    path.write_bytes("first line\r\n\nthird, line ✓\nlast".encode())
    got = _texts(_corpus(tmp_path, path=str(path), text_column="ignored"), batch_rows=2)
    assert got == ["first line", "", "third, line ✓", "last"]


@pytest.mark.parametrize("fmt,ext", [("parquet", "parquet"), ("jsonl", "jsonl"), ("csv", "csv")])
def test_custom_text_column(tmp_path, fmt, ext):
    path = build_local(tmp_path / f"c.{ext}", fmt, _rows(column="body"))
    assert _texts(_corpus(tmp_path, path=str(path), text_column="body")) == TEXTS


def test_folder_of_parquet_files_in_sorted_order_and_max_examples(tmp_path):
    texts = [f"text {i}" for i in range(25)]
    (tmp_path / "c4" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"text": texts[:10]}), tmp_path / "c4" / "part-0.parquet", row_group_size=3)
    pq.write_table(pa.table({"text": texts[10:]}), tmp_path / "c4" / "sub" / "part-1.parquet")
    (tmp_path / "c4" / "README.md").write_text("not data")
    assert _texts(_corpus(tmp_path, path=str(tmp_path / "c4"))) == texts
    capped = _corpus(tmp_path, path=str(tmp_path / "c4"), max_examples=13)
    assert _texts(capped, batch_rows=5) == texts[:13] and capped.n_read == 13


@pytest.mark.parametrize("fmt,ext", [("parquet", "parquet"), ("jsonl", "jsonl"), ("csv", "csv"), ("txt", "txt")])
def test_max_examples_every_format(tmp_path, fmt, ext):
    texts = [f"t{i}" for i in range(11)]
    if fmt == "txt":
        path = tmp_path / "c.txt"
        path.write_text("\n".join(texts) + "\n")
    else:
        path = build_local(tmp_path / f"c.{ext}", fmt, _rows(texts))
    assert _texts(_corpus(tmp_path, path=str(path), max_examples=7), batch_rows=3) == texts[:7]


def test_large_row_group_is_cut_to_batch_rows(tmp_path):
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": [f"x{i}" for i in range(100)]}), path, row_group_size=100)
    batches = list(_corpus(tmp_path, path=str(path)).iter_batches(batch_rows=30))
    assert [b.num_rows for b in batches] == [30, 30, 30, 10]


# ---------------------------------------------------------------- hub route (offline)


def test_hub_route_streams_through_load_dataset(tmp_path, monkeypatch):
    """The hub code path, with load_dataset pointed at a local Parquet file as the CC-News tests do."""
    import datasets

    texts = [f"c4 document {i}" for i in range(30)]
    local = tmp_path / "c4-validation.parquet"
    pq.write_table(pa.table({"text": texts, "timestamp": ["2019"] * 30, "url": ["u"] * 30}), local,
                   row_group_size=8)
    real = datasets.load_dataset
    calls = []

    def fake_load_dataset(path, name=None, *, split=None, streaming=False, **kw):
        calls.append((path, name, split, streaming))
        if path != "allenai/c4":
            raise FileNotFoundError(f"Dataset {path!r} doesn't exist on the Hub")
        return real("parquet", data_files={split: [str(local)]}, split=split, streaming=streaming, **kw)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    spec = {**_local_dataset(tmp_path),
            "public": {"hub_name": "allenai/c4", "hub_config": "en", "hub_split": "validation", "max_examples": 17}}
    src = open_source("so", spec, tmp_path / "data")
    assert src.has_public()
    assert _texts(src, batch_rows=5) == texts[:17]
    assert calls == [("allenai/c4", "en", "validation", True)]  # streamed: nothing downloaded up front

    bad = open_source("so", {**spec, "public": {"hub_name": "allenai/c5"}}, tmp_path / "data")
    with pytest.raises(DataError, match=r"hub dataset 'allenai/c5'.*datasets\.so\.public.*loading failed"):
        list(bad.iter_public())
    nocol = open_source("so", {**spec, "public": {"hub_name": "allenai/c4", "text_column": "body"}}, tmp_path / "data")
    with pytest.raises(DataError, match=r"missing column\(s\) \['body'\]; the dataset has columns \['text', 'timestamp', 'url'\]"):
        list(nocol.iter_public())


# ---------------------------------------------------------------- routing through open_source


@pytest.mark.parametrize("source", ["local", "stackoverflow", "cc_news"])
def test_every_source_gets_a_public_part_from_the_key(tmp_path, source):
    pub = build_local(tmp_path / "c4.jsonl", "jsonl", _rows())
    spec = {"source": source, "path": str(tmp_path / "whatever")} if source != "local" else _local_dataset(tmp_path)
    assert not has_public_part(spec)
    spec = {**spec, "public": {"path": str(pub)}}
    assert has_public_part(spec)
    src = open_source("so", spec, tmp_path / "data")
    assert isinstance(src, WithPublicCorpus) and src.has_public()
    assert _texts(src) == TEXTS


def test_local_private_part_is_unchanged_by_the_wrapper(tmp_path):
    pub = build_local(tmp_path / "c4.csv", "csv", _rows())
    spec = {**_local_dataset(tmp_path), "public": {"path": str(pub)}}
    src = open_source("mine", spec, tmp_path / "data")
    private = pa.Table.from_batches(list(src.iter_batches(100)))
    assert private.column("user_id").to_pylist()[:2] == ["alice", "bob"]
    assert src.format == "parquet" and src.name == "mine"  # attributes of the wrapped source
    src.download()  # checks both files exist


def test_public_key_replaces_builtin_public_part_of_synthetic_and_fortunes(tmp_path):
    pub = tmp_path / "c4.txt"
    pub.write_text("only this\nand this\n")
    synth = {"source": "synthetic", "synthetic": {"n_users": 5, "public_examples": 0}}
    assert not has_public_part(synth)
    synth["public"] = {"path": str(pub)}
    assert has_public_part(synth)
    assert _texts(open_source("synth", synth, tmp_path / "data")) == ["only this", "and this"]
    fortunes = build_fortune_file(tmp_path / "f", [("unattributed wisdom", None), ("a quote", "Ann")])
    spec = {"source": "fortunes", "path": str(fortunes)}
    assert _texts(open_source("f", spec, tmp_path / "data")) == ["unattributed wisdom"]
    assert _texts(open_source("f", {**spec, "public": {"path": str(pub)}}, tmp_path / "data")) == ["only this", "and this"]
    # public: null means no user-named corpus: the built-in part stays
    assert not isinstance(open_source("f", {**spec, "public": None}, tmp_path / "data"), WithPublicCorpus)


def test_write_public_drops_and_counts_empty_texts(tmp_path):
    pub = build_local(tmp_path / "c4.parquet", "parquet", _rows(["  a  b ", "", None, "\t\n", "c"]))
    src = open_source("mine", {**_local_dataset(tmp_path), "public": {"path": str(pub)}}, tmp_path / "data")
    info = write_public(src, "mine", tmp_path / "out" / "public.parquet", batch_rows=2)
    assert pq.read_table(tmp_path / "out" / "public.parquet").column("text").to_pylist() == ["a b", "c"]
    assert info == {"n_public": 2, "dropped_empty": 3}


def test_only_empty_texts_is_an_error_naming_the_key_and_file(tmp_path):
    pub = tmp_path / "blank.txt"
    pub.write_text("\n  \n\n")
    src = open_source("mine", {**_local_dataset(tmp_path), "public": {"path": str(pub)}}, tmp_path / "data")
    with pytest.raises(DataError, match=r"dataset mine: the public part \(datasets\.mine\.public: .*blank\.txt\) "
                                        r"has no non-empty text \(3 empty"):
        write_public(src, "mine", tmp_path / "public.parquet")
    assert not (tmp_path / "public.parquet").exists()


def test_tokenizer_public_dataset_may_name_a_dataset_with_a_public_key(tmp_path):
    spec = {**_local_dataset(tmp_path), "public": {"path": "c4.parquet"}}
    config = {"tokenizer": {"public_dataset": "mine"}, "datasets": {"mine": spec}}
    assert public_dataset_name(config) == "mine"
    config["tokenizer"]["public_dataset"] = None
    assert public_dataset_name(config) == "mine"


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "public,pattern",
    [
        ({"path": "a.parquet", "colum": "x", "hub_nmae": "c4"},
         r"datasets\.so\.public\.colum, datasets\.so\.public\.hub_nmae: not a key of a public corpus; allowed keys: "
         r"\['format', 'hub_config', 'hub_name', 'hub_split', 'max_examples', 'path', 'separator', 'text_column'\]"),
        ({"path": "a.parquet", "hub_name": "allenai/c4"},
         r"datasets\.so\.public has both of datasets\.so\.public\.path and datasets\.so\.public\.hub_name"),
        ({"text_column": "text"},
         r"datasets\.so\.public has neither of datasets\.so\.public\.path and datasets\.so\.public\.hub_name"),
        ({}, r"has neither of datasets\.so\.public\.path"),
        ("/data/c4.parquet", r"datasets\.so\.public is '/data/c4\.parquet'; it must be a mapping"),
        ({"path": "a.parquet", "max_examples": 0}, r"datasets\.so\.public\.max_examples is 0; it must be an integer >= 1"),
        ({"path": "a.parquet", "max_examples": True}, r"datasets\.so\.public\.max_examples is True"),
        ({"path": "a.parquet", "text_column": ""}, r"datasets\.so\.public\.text_column is ''; it must be a non-empty"),
        ({"path": "a.parquet", "hub_split": "train"}, r"datasets\.so\.public\.hub_split is only used with"),
        ({"hub_name": 3}, r"datasets\.so\.public\.hub_name is 3"),
    ],
)
def test_bad_spec_is_a_config_error_naming_the_key(tmp_path, public, pattern):
    with pytest.raises(ConfigError, match=pattern):
        open_source("so", {**_local_dataset(tmp_path), "public": public}, tmp_path / "data")


def test_missing_file_and_folder_without_parquet(tmp_path):
    src = open_source("so", {**_local_dataset(tmp_path), "public": {"path": str(tmp_path / "nope.parquet")}},
                      tmp_path / "data")
    with pytest.raises(DataError, match=r"nope\.parquet \(datasets\.so\.public\.path\) does not exist"):
        src.download()
    with pytest.raises(DataError, match=r"nope\.parquet \(datasets\.so\.public\.path\) does not exist"):
        list(src.iter_public())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"empty \(datasets\.so\.public\.path\) is a folder without \.parquet files"):
        list(_corpus(tmp_path, path=str(tmp_path / "empty")).iter_batches())


def test_unknown_extension(tmp_path):
    path = tmp_path / "c4.xlsx"
    path.write_text("text\nx\n")
    with pytest.raises(ConfigError, match=r"datasets\.so\.public\.format is auto but the extension of .*c4\.xlsx "
                                          r"\(\.xlsx\) is not one of \['\.csv', '\.jsonl', '\.ndjson', '\.parquet', "
                                          r"'\.pq', '\.tab', '\.tsv', '\.txt'\]"):
        list(_corpus(tmp_path, path=str(path)).iter_batches())


@pytest.mark.parametrize("fmt,ext", [("parquet", "parquet"), ("jsonl", "jsonl"), ("csv", "csv")])
def test_missing_text_column_lists_the_columns_found(tmp_path, fmt, ext):
    path = build_local(tmp_path / f"c4.{ext}", fmt, _rows(column="body"))
    with pytest.raises(DataError, match=rf"c4\.{ext} \(datasets\.so\.public, format {fmt}\): missing column\(s\) "
                                        r"\['text'\]; the file has columns \['url', 'body'\]\. Set "
                                        r"datasets\.so\.public\.text_column"):
        list(_corpus(tmp_path, path=str(path)).iter_batches())


def test_missing_text_column_in_one_file_of_a_folder(tmp_path):
    (tmp_path / "c4").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "c4" / "a.parquet")
    pq.write_table(pa.table({"content": ["b"]}), tmp_path / "c4" / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet \(datasets\.so\.public, format parquet\): missing column\(s\) "
                                        r"\['text'\].*\['content'\]"):
        list(_corpus(tmp_path, path=str(tmp_path / "c4")).iter_batches())


@pytest.mark.parametrize("fmt,ext", [("parquet", "parquet"), ("csv", "csv"), ("jsonl", "jsonl"), ("txt", "txt")])
def test_no_rows_is_an_error_naming_the_key_and_file(tmp_path, fmt, ext):
    path = tmp_path / f"empty.{ext}"
    if fmt == "parquet":
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    elif fmt == "csv":
        path.write_text("text\n")
    else:
        path.write_text("")
    # a 0-byte file is refused as empty before any reading; a header or schema without rows has no rows
    what = "the file is empty" if fmt in ("jsonl", "txt") else "no rows"
    with pytest.raises(DataError, match=rf"empty\.{ext} \(datasets\.so\.public, format {fmt}\): .*{what}"):
        list(_corpus(tmp_path, path=str(path)).iter_batches())


def test_bad_content(tmp_path):
    bad_utf8 = tmp_path / "latin1.txt"
    bad_utf8.write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"latin1\.txt \(datasets\.so\.public, format txt\): line 2 \(byte offset 8\) is not UTF-8"):
        list(_corpus(tmp_path, path=str(bad_utf8)).iter_batches())
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl \(datasets\.so\.public, format jsonl\): line 2 is not valid JSON"):
        list(_corpus(tmp_path, path=str(bad_json)).iter_batches())
    numbers = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    with pytest.raises(DataError, match=r"n\.parquet \(datasets\.so\.public, format parquet\): row 1, column 'text' holds "
                                         r"int64 values \(1\), not text"):
        list(_corpus(tmp_path, path=str(numbers)).iter_batches())
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"fake\.parquet \(datasets\.so\.public, format parquet\): not a valid Parquet "
                                         r"file"):
        list(_corpus(tmp_path, path=str(not_parquet)).iter_batches())


# ---------------------------------------------------------------- the data rules (real snakemake)

DATA_ONLY = """\
from snakemake.utils import min_version, validate
configfile: "config/config.yaml"
include: "workflow/rules/common.smk"
validate(config, "workflow/schemas/config.schema.yaml")
include: "workflow/rules/data.smk"
"""


def data_workflow(tmp_path: Path) -> Path:
    """A working folder whose Snakefile has the data rules only (DATA_ONLY); the config goes in config/."""
    wd = tmp_path / "wf"
    (wd / "config").mkdir(parents=True)
    os.symlink(REPO / "workflow", wd / "workflow")
    (wd / "Snakefile").write_text(DATA_ONLY)
    return wd


@pytest.mark.integration
def test_snakemake_builds_public_parquet_of_a_local_dataset_and_trains_the_tokenizer_on_it(tmp_path):
    wd = data_workflow(tmp_path)
    private = build_local(tmp_path / "private.csv", "csv",
                          [{"user_id": f"u{i % 7}", "text": f"private note number {i}"} for i in range(40)])
    pub = tmp_path / "c4.jsonl"
    pub.write_text("".join(json.dumps({"text": f"public web page {i} about cooking and sports"}) + "\n"
                           for i in range(300)) + '{"text": ""}\n')
    (wd / "config" / "config.yaml").write_text(f"""\
seed: 0
datasets:
  mine:
    source: local
    path: {private}
    public:
      path: {pub}
      max_examples: 250
tokenizer: {{vocab_size: 300, sequence_length: 16, public_dataset: mine, batch_rows: 100}}
grid: {{datasets: [mine], methods: [els], epsilons: [1], budgets: [{{compute: 100, steps: 2}}]}}
""")
    targets = ["results/data/mine/public.parquet", "results/data/mine/public_tokens.parquet"]
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *targets], cwd=wd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    public = pq.read_table(wd / "results" / "data" / "mine" / "public.parquet")
    assert public.schema.names == ["text"] and public.num_rows == 250
    assert public.column("text")[0].as_py() == "public web page 0 about cooking and sports"
    info = json.loads((wd / "results" / "tokenizer" / "tokenizer_info.json").read_text())
    assert info["trained_on"] == "results/data/mine/public.parquet" and info["n_texts"] == 250
    assert pq.read_table(wd / "results" / "data" / "mine" / "public_tokens.parquet").num_rows == 250
    # the private data was never an input of the tokenizer
    assert not (wd / "results" / "data" / "mine" / "examples.parquet").exists()


def test_hub_snapshot_taken_by_download_and_read_offline(tmp_path, monkeypatch):
    """download() (the local download rule) saves the streamed hub rows; later reads never call the hub."""
    import datasets

    texts = [f"c4 page {i}" for i in range(25)]
    local = tmp_path / "c4.parquet"
    pq.write_table(pa.table({"body": texts, "url": ["u"] * 25}), local, row_group_size=7)
    real = datasets.load_dataset
    calls = []

    def fake_load_dataset(path, name=None, *, split=None, streaming=False, **kw):
        calls.append(path)
        return real("parquet", data_files={split: [str(local)]}, split=split, streaming=streaming, **kw)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    public = {"hub_name": "allenai/c4", "hub_config": "en", "text_column": "body", "max_examples": 20}
    spec = {**_local_dataset(tmp_path), "public": public}
    src = open_source("so", spec, tmp_path / "data")
    src.download()
    snaps = sorted((tmp_path / "data" / "so").glob("public_hub-*.parquet"))
    assert len(snaps) == 1 and pq.read_table(snaps[0]).column("text").to_pylist() == texts[:20]
    assert calls == ["allenai/c4"]

    def no_network(*a, **kw):
        raise AssertionError("the hub was contacted after the snapshot was taken")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    again = open_source("so", spec, tmp_path / "data")
    assert _texts(again, batch_rows=6) == texts[:20]
    again.download()  # an existing snapshot is kept, not fetched again
    # a different cap is a different snapshot: it would be fetched anew
    other = open_source("so", {**spec, "public": {**public, "max_examples": 5}}, tmp_path / "data")
    with pytest.raises(DataError, match="loading failed: AssertionError: the hub was contacted"):
        other.download()
    assert len(list((tmp_path / "data" / "so").glob("public_hub-*.parquet"))) == 1  # no half-written snapshot
