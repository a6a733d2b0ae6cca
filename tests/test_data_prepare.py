"""The prepare stage: cleaning, user split, filters, contribution statistics, public text."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userdp.data.base import PUBLIC_SCHEMA, RAW_SCHEMA
from userdp.data.prepare import (
    clean_text,
    hash_split,
    prepare_dataset,
    write_public,
)
from userdp.data.sources import has_public_part
from userdp.data.synthetic import SyntheticSource
from userdp.errors import DataError
from userdp.data.prepare import _split_hash
from userdp.seeding import unit_interval, user_hashes

OUTPUTS = ("examples.parquet", "users.parquet", "contributions.json")


class ListSource:
    """A Source over in-memory rows (user_id, text[, source_split]), yielded in small batches."""

    def __init__(self, users, texts, source_split=None, public=None):
        self.spec = {"source": "local"}
        n = len(users)
        self.table = pa.table(
            {"user_id": users, "text": texts, "source_split": source_split or [None] * n}, schema=RAW_SCHEMA
        )
        self.public = public

    def iter_batches(self, batch_rows=10_000):
        yield from self.table.to_batches(max_chunksize=min(batch_rows, 7))

    def has_public(self):
        return self.public is not None

    def iter_public(self, batch_rows=10_000):
        yield from pa.table({"text": self.public}, schema=PUBLIC_SCHEMA).to_batches(max_chunksize=5)


def read(out, name):
    return pq.read_table(out / name)


# ---------------------------------------------------------------- split


def test_hash_is_deterministic_seeded_and_uniform():
    ids = pa.array([f"user-{i}" for i in range(20000)])
    u = _split_hash(ids, 123)
    assert np.array_equal(u, _split_hash(ids, 123))
    assert not np.array_equal(u, _split_hash(ids, 124))
    # Same id, same value, whatever the batch it comes in.
    assert np.array_equal(_split_hash(ids.slice(5000, 10), 123), u[5000:5010])
    assert _split_hash(pa.array(["user-7"]), 123)[0] == u[7]
    assert 0 <= u.min() and u.max() < 1
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert hist.min() > 1800 and hist.max() < 2200  # ~2000 per decile
    # Non-ASCII and empty ids hash fine.
    assert len(_split_hash(pa.array(["", "ümlaut", "日本"]), 1)) == 3
    # A keyed hash of its own: not the bounding or sampling key of the same id and seed.
    assert not np.array_equal(u[:100], unit_interval(user_hashes(ids.slice(0, 100).to_pylist(), 123)))


def test_split_fractions_approximately_right():
    ids = pa.array([f"u{i}" for i in range(50000)])
    codes = hash_split(ids, seed=0, validation=0.2, test=0.1)
    frac = np.bincount(codes, minlength=3) / len(codes)
    assert frac == pytest.approx([0.7, 0.2, 0.1], abs=0.01)


def synth_source(n_users=2000, seed=0, **kw):
    spec = {"source": "synthetic", "synthetic": {"n_users": n_users, "public_examples": 300, **kw}}
    return spec, SyntheticSource("synth", spec, "data/synth", seed)


def test_prepare_synthetic_split_disjoint_and_deterministic(tmp_path):
    spec, src = synth_source()
    spec["split"] = {"validation": 0.15, "test": 0.1}
    stats = prepare_dataset(src, "synth", spec, tmp_path / "a", seed=3, batch_rows=999)
    ex = read(tmp_path / "a", "examples.parquet")
    users = read(tmp_path / "a", "users.parquet")
    assert ex.schema.names == ["user_id", "example_id", "split", "text"]
    assert ex.schema.field("example_id").type == pa.int64()
    ids = ex.column("example_id").to_numpy()
    assert len(np.unique(ids)) == len(ids)
    # Every user is in exactly one split, and its examples carry that split.
    per_user = ex.group_by("user_id").aggregate([("split", "count_distinct")])
    assert max(per_user.column("split_count_distinct").to_pylist()) == 1
    joined = ex.join(users, "user_id", right_suffix="_u")
    assert pc_equal(joined.column("split"), joined.column("split_u"))
    frac = {s: stats["n_users"][s] / 2000 for s in ("train", "validation", "test")}
    assert frac["validation"] == pytest.approx(0.15, abs=0.03)
    assert frac["test"] == pytest.approx(0.10, abs=0.03)
    assert sum(stats["n_examples"].values()) == ex.num_rows == int(src.n_examples.sum())
    # Rerun with another batch size: byte-identical tables.
    prepare_dataset(synth_source()[1], "synth", spec, tmp_path / "b", seed=3, batch_rows=5000)
    assert read(tmp_path / "b", "examples.parquet").equals(ex)
    assert read(tmp_path / "b", "users.parquet").equals(users)
    # Another seed moves users between splits.
    prepare_dataset(synth_source()[1], "synth", spec, tmp_path / "c", seed=4)
    assert not read(tmp_path / "c", "users.parquet").column("split").equals(users.column("split"))


def pc_equal(a, b) -> bool:
    return a.to_pylist() == b.to_pylist()


def test_contribution_stats_fields(tmp_path):
    spec, src = synth_source(n_users=3000, contributions_median=6)
    prepare_dataset(src, "synth", spec, tmp_path, seed=0)
    stats = json.loads((tmp_path / "contributions.json").read_text())
    users = read(tmp_path, "users.parquet").to_pandas()
    train = users[users.split == "train"].n_examples.to_numpy()
    for key in ("n_users", "n_examples"):
        assert set(stats[key]) == {"train", "validation", "test"}
    assert stats["median_train"] == float(np.median(train))
    assert stats["max_train"] == int(train.max())
    assert stats["mean_train"] == pytest.approx(train.mean())
    assert {"0.5", "0.9", "0.99"} <= set(stats["quantiles_train"])
    assert stats["quantiles_train"]["0.99"] == pytest.approx(np.quantile(train, 0.99))
    assert sum(stats["histogram_train"]["counts"]) == len(train)
    edges = stats["histogram_train"]["bin_edges"]
    assert edges[0] == 1 and all(b == 2 * a for a, b in zip(edges, edges[1:])) and edges[-1] > train.max()
    assert sum(stats["frequency_train"]["n_users"]) == len(train)
    assert stats["treated_as_public"] is True
    assert set(stats["dropped"]) >= {"null_or_empty_text", "below_min_examples_per_user"}
    # Nothing in the statistics depends on the contribution bound G.
    assert not any("group" in k.lower() or k == "G" for k in stats)


def test_private_stats_write_only_the_users_per_split(tmp_path, caplog):
    """privacy.contribution_stats.private: contributions.json and the log hold no count of examples."""
    import logging

    from userdp.data.prepare import PUBLIC_FIELDS

    spec, src = synth_source(n_users=500, contributions_median=6)
    with caplog.at_level(logging.INFO, logger="userdp.data.prepare"):
        returned = prepare_dataset(src, "synth", spec, tmp_path / "dp", seed=0, private_stats=True)
    stats = json.loads((tmp_path / "dp" / "contributions.json").read_text())
    assert stats == returned
    assert set(stats) == set(PUBLIC_FIELDS) | {"treated_as_public", "contribution_stats_private", "privacy_note"}
    assert stats["treated_as_public"] is False and stats["contribution_stats_private"] is True
    exact = prepare_dataset(synth_source(n_users=500, contributions_median=6)[1], "synth", spec, tmp_path / "x", seed=0)
    assert stats["n_users"] == exact["n_users"]  # the public sizes are the same
    # The data files are the same as without the option; only the statistics file changes.
    for name in ("examples.parquet", "users.parquet"):
        assert read(tmp_path / "dp", name).equals(read(tmp_path / "x", name))
    log_text = " ".join(r.getMessage() for r in caplog.records)
    numbers = {int(x) for x in __import__("re").findall(r"\d+", log_text)}
    hidden = {exact["n_raw_examples"], exact["max_train"], *exact["n_examples"].values()}
    assert not numbers & hidden, log_text


def test_cleaning_and_dropped_counts(tmp_path):
    users = ["a", "a", "a", "b", "b", "c", "d", "d", "d"]
    texts = ["  hello\t\tworld \n", "", "   ", "x", None, "only one", "p", "q", "r"]
    src = ListSource(users, texts)
    spec = {"source": "local", "min_examples_per_user": 2, "split": {"validation": 0.0, "test": 0.0}}
    stats = prepare_dataset(src, "toy", spec, tmp_path, seed=0)
    ex = read(tmp_path, "examples.parquet").to_pylist()
    assert [r["text"] for r in ex if r["user_id"] == "a"] == []  # a keeps one example < 2
    assert sorted(r["user_id"] for r in ex) == ["d", "d", "d"]
    assert [r["example_id"] for r in ex] == [0, 1, 2]  # renumbered after filtering
    assert stats["dropped"]["null_or_empty_text"] == 3
    # a (1 left after cleaning), b (1), c (1) fall below 2 examples.
    assert stats["dropped_users"]["below_min_examples_per_user"] == 3
    assert stats["dropped"]["below_min_examples_per_user"] == 3
    assert stats["n_users"] == {"train": 1, "validation": 0, "test": 0}


def test_clean_text_collapses_unicode_whitespace():
    raw = ["a b", "  hello\t\tworld \n", None, "", "   ", "x\u00a0\u00a0y", "café  bar", "a\u2003b", " a", "ok"]
    assert clean_text(pa.array(raw)).to_pylist() == [
        "a b", "hello world", None, "", "", "x y", "café bar", "a b", "a", "ok"
    ]
    clean = pa.array(["already clean", "fine"])
    assert clean_text(clean).to_pylist() == clean.to_pylist()


def test_zero_users_error_names_dataset_and_leaves_no_output(tmp_path):
    src = ListSource(["a", "b"], ["x", "y"])
    spec = {"source": "local", "min_examples_per_user": 5}
    with pytest.raises(DataError, match=r"toy.*min_examples_per_user=5"):
        prepare_dataset(src, "toy", spec, tmp_path, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="no users left"):
        prepare_dataset(ListSource(["a"], ["   "]), "toy", {"source": "local"}, tmp_path, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_null_user_id_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="null user id"):
        prepare_dataset(ListSource(["a", None], ["x", "y"]), "toy", {"source": "local"}, tmp_path, seed=0)
    assert list(tmp_path.iterdir()) == []


def so_like():
    """Stack Overflow semantics: train users have train+test rows; heldout users are disjoint."""
    users, texts, splits = [], [], []
    for i in range(400):
        heldout = i % 10 == 0
        for j in range(3):
            users.append(f"{i}")
            texts.append(f"post {i} {j}")
            splits.append("heldout" if heldout else "train")
        if not heldout:
            users.append(f"{i}")
            texts.append(f"later post {i}")
            splits.append("test")
    return users, texts, splits


def test_source_split_heldout_users_evaluate_and_test_rows_of_train_users_dropped(tmp_path):
    users, texts, splits = so_like()
    spec = {"source": "stackoverflow", "split": {"validation": 0.1, "test": 0.1, "use_source_split": True}}
    stats = prepare_dataset(ListSource(users, texts, splits), "so", spec, tmp_path, seed=0)
    ex = read(tmp_path, "examples.parquet").to_pandas()
    assert not ex.text.str.startswith("later").any()  # never the test rows of train users
    assert stats["dropped"]["source_test_rows"] == 360
    heldout = {f"{i}" for i in range(0, 400, 10)}
    eval_users = set(ex[ex.split != "train"].user_id)
    assert eval_users == heldout
    assert set(ex[ex.split == "train"].user_id).isdisjoint(heldout)
    assert stats["n_users"]["validation"] > 5 and stats["n_users"]["test"] > 5  # 50:50 of 40 heldout users
    # Without the source split: hash split of all users, all rows kept.
    spec["split"]["use_source_split"] = False
    stats = prepare_dataset(ListSource(users, texts, splits), "so", spec, tmp_path / "hash", seed=0)
    assert stats["dropped"]["source_test_rows"] == 0
    assert sum(stats["n_examples"].values()) == len(users)


def test_source_split_not_user_disjoint_is_an_error(tmp_path):
    spec = {"source": "stackoverflow"}
    src = ListSource(["a", "a"], ["x", "y"], ["train", "heldout"])
    with pytest.raises(DataError, match="use_source_split: false"):
        prepare_dataset(src, "so", spec, tmp_path, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_max_examples_is_applied(tmp_path):
    src = ListSource([f"u{i}" for i in range(30)], ["t"] * 30)
    stats = prepare_dataset(src, "toy", {"source": "local", "max_examples": 12}, tmp_path, seed=0)
    assert stats["n_raw_examples"] == 12 and sum(stats["n_examples"].values()) == 12


def test_public_part(tmp_path):
    src = ListSource(["a"], ["x"], public=["  some  public text ", "", "more"])
    info = write_public(src, "toy", tmp_path / "public.parquet")
    assert read(tmp_path, "public.parquet").column("text").to_pylist() == ["some public text", "more"]
    assert info == {"n_public": 2, "dropped_empty": 1}
    with pytest.raises(DataError, match="no public part"):
        write_public(ListSource(["a"], ["x"]), "toy", tmp_path / "none.parquet")
    assert not (tmp_path / "none.parquet").exists()


def test_has_public_part_from_config_alone():
    assert has_public_part({"source": "synthetic"})
    assert not has_public_part({"source": "synthetic", "synthetic": {"public_examples": 0}})
    assert has_public_part({"source": "fortunes"})
    assert not has_public_part({"source": "stackoverflow"})
    assert not has_public_part({"source": "local", "path": "x.parquet"})


def test_contributions_figure(tmp_path):
    from userdp.plotting.contributions import plot_contributions

    spec, src = synth_source(n_users=500)
    prepare_dataset(src, "synth", spec, tmp_path, seed=0)
    plot_contributions(tmp_path / "contributions.json", tmp_path / "c.png", tmp_path / "c.pdf")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "c.pdf").read_bytes()[:4] == b"%PDF"


def test_rule_wildcard_regexes():
    import re

    from userdp.layout import names_regex

    rx = names_regex(["synth", "so-2"])
    assert re.fullmatch(rx, "synth") and re.fullmatch(rx, "so-2")
    assert not re.fullmatch(rx, "synth2") and not re.fullmatch(rx, "so")
    assert not re.fullmatch(names_regex([]), "") and not re.fullmatch(names_regex([]), "x")
