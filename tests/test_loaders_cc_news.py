"""CC-News loader through `datasets.load_dataset("parquet", ...)`, the hub's code path."""

from __future__ import annotations

import pytest

from builders import CC_NEWS_COLUMNS, build_cc_news_parquet, cc_news_rows
from userdp.data.base import RAW_SCHEMA
from userdp.data.cc_news import CCNewsSource
from userdp.errors import ConfigError, DataError


def _source(tmp_path, **spec):
    return CCNewsSource("news", {"source": "cc_news", **spec}, tmp_path / "data" / "news")


def _rows(source, batch_rows=4):
    batches = list(source.iter_batches(batch_rows))
    assert all(b.schema.equals(RAW_SCHEMA) and b.num_rows <= batch_rows for b in batches)
    return [r for b in batches for r in zip(*(b.column(c).to_pylist() for c in RAW_SCHEMA.names))]


@pytest.mark.parametrize("streaming", [False, True])
def test_reads_parquet_users_are_domains(tmp_path, streaming):
    path = build_cc_news_parquet(tmp_path / "news.parquet")
    rows = _rows(_source(tmp_path, path=str(path), streaming=streaming))
    assert rows == [(r["domain"], r["text"], None) for r in cc_news_rows()]


def test_folder_of_parquet_files_title_and_max_examples(tmp_path):
    rows = cc_news_rows(12)
    build_cc_news_parquet(tmp_path / "dir" / "part-0.parquet", rows[:6])
    build_cc_news_parquet(tmp_path / "dir" / "part-1.parquet", rows[6:])
    got = _rows(_source(tmp_path, path=str(tmp_path / "dir"), include_title=True, max_examples=8), batch_rows=5)
    assert len(got) == 8
    assert got[7] == (rows[7]["domain"], f"{rows[7]['title']}\n\n{rows[7]['text']}", None)


def test_rows_without_domain_are_dropped_empty_text_kept(tmp_path):
    rows = cc_news_rows(4)
    rows[1]["domain"] = None
    rows[2]["domain"] = "  "
    rows[3]["text"] = ""
    src = _source(tmp_path, path=str(build_cc_news_parquet(tmp_path / "n.parquet", rows)))
    got = _rows(src)
    assert [u for u, _, _ in got] == [rows[0]["domain"], rows[3]["domain"]]
    assert got[1][1] == ""
    assert src.dropped_no_domain == 2


def test_missing_column_names_file_and_lists_columns(tmp_path):
    cols = [c for c in CC_NEWS_COLUMNS if c != "domain"]
    path = build_cc_news_parquet(tmp_path / "nodomain.parquet", columns=cols)
    with pytest.raises(DataError, match=r"nodomain\.parquet lacks column\(s\) \['domain'\].*'description'"):
        list(_source(tmp_path, path=str(path)).iter_batches())


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet.*does not exist"):
        list(_source(tmp_path, path=str(tmp_path / "nope.parquet")).iter_batches())
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty.*no \.parquet files"):
        list(_source(tmp_path, path=str(tmp_path / "empty")).iter_batches())


def test_not_parquet_is_a_data_error(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("title,text\nx,y\n")
    with pytest.raises(DataError, match=r"bad\.parquet"):
        list(_source(tmp_path, path=str(bad)).iter_batches())


def test_spec_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\.news\.user_column.*'hub_name'"):
        _source(tmp_path, user_column="domain")
