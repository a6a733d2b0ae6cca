"""Canary users, the audit's training table, its config checks and targets (no model, no training)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.stats

from train_fixtures import tokens_table
from userdp import grid
from userdp.config import load_config, validate_config
from userdp.data import canaries as canaries_lib
from userdp.errors import ConfigError, DataError

META = {"vocab_size": 40, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _config(**audit) -> dict:
    cfg = {"datasets": {"d": {"source": "synthetic"}}, "tokenizer": {"sequence_length": 24}, "audit": audit}
    return validate_config(cfg)


def test_canaries_are_seeded_distinct_and_fair_coins():
    spec = canaries_lib.CanarySpec(2000, 3, 6, seed=1)
    a = canaries_lib.make_canaries(spec, META, 0, "d")
    assert a.equals(canaries_lib.make_canaries(spec, META, 0, "d"))
    assert not a.equals(canaries_lib.make_canaries(canaries_lib.CanarySpec(2000, 3, 6, seed=2), META, 0, "d"))
    inc = np.array(a["included"].to_pylist())
    assert scipy.stats.binomtest(int(inc.sum()), inc.size, 0.5).pvalue > 1e-3  # Bernoulli(1/2) coins
    secrets = np.array(a["secret"].to_pylist())
    assert secrets.shape == (2000, 6) and secrets.min() >= 3 and secrets.max() < 40  # no special token
    assert all(s == [1, *sec, 2] for s, sec in zip(a["input_ids"].to_pylist(), secrets.tolist()))
    assert len(set(a["user_id"].to_pylist())) == 2000 and len({tuple(s) for s in secrets.tolist()}) == 2000
    assert set(a["n_examples"].to_pylist()) == {3}


def test_audit_tokens_hold_the_train_rows_and_the_included_canaries(tmp_path):
    tokens = tokens_table(30, seed=0, vocab=40)
    tokens = tokens.replace_schema_metadata({"userdp": json.dumps(META)})
    pq.write_table(tokens, tmp_path / "tokens.parquet")
    can = canaries_lib.make_canaries(canaries_lib.CanarySpec(20, 3, 5, 0), META, 0, "d")
    info = canaries_lib.write_audit_tokens(tmp_path / "tokens.parquet", can, tmp_path / "audit.parquet", batch_rows=7)
    out = pq.read_table(tmp_path / "audit.parquet")
    assert out.schema.metadata == tokens.schema.metadata
    n_train = int(np.sum(np.array(tokens["split"].to_pylist()) == "train"))
    n_in = int(np.sum(can["included"].to_pylist()))
    assert info == {"dataset_train_rows": n_train, "canary_rows": 3 * n_in, "dataset_train_users": None,
                    "canaries_included": n_in, "canaries": 20}
    assert out.num_rows == n_train + 3 * n_in and set(out["split"].to_pylist()) == {"train"}
    ids = out["example_id"].to_numpy()
    assert len(np.unique(ids)) == len(ids)
    canary_rows = out.slice(n_train)
    assert canary_rows["example_id"].to_numpy().min() > tokens["example_id"].to_numpy().max()
    included = {u for u, i in zip(can["user_id"].to_pylist(), can["included"].to_pylist()) if i}
    assert set(canary_rows["user_id"].to_pylist()) == included


def test_a_dataset_user_with_the_canary_prefix_is_refused(tmp_path):
    tokens = tokens_table(5, seed=0, vocab=40)
    users = pa.array(["canary-x"] * tokens.num_rows)
    tokens = tokens.set_column(0, "user_id", users).replace_schema_metadata({"userdp": json.dumps(META)})
    pq.write_table(tokens, tmp_path / "tokens.parquet")
    can = canaries_lib.make_canaries(canaries_lib.CanarySpec(4, 1, 3, 0), META, 0, "d")
    with pytest.raises(DataError, match="canary prefix"):
        canaries_lib.write_audit_tokens(tmp_path / "tokens.parquet", can, tmp_path / "audit.parquet")
    assert not (tmp_path / "audit.parquet").exists()  # nothing half-written


def test_tokens_without_metadata_are_refused():
    with pytest.raises(DataError, match="rule tokenize"):
        canaries_lib.tokens_meta(pa.schema([("user_id", pa.string())]), "x.parquet")


def test_audit_config_checks():
    # bos + prefix (8 by default) + secret + eos must fit the sequence length (24 here)
    with pytest.raises(ConfigError, match="audit.secret_length is 15.*at most 14"):
        _config(secret_length=15)
    _config(secret_length=14)
    _config(secret_length=22, prefix_length=0)
    with pytest.raises(ConfigError, match="audit.prefix_length is 22.*at most 21"):
        _config(prefix_length=22)
    with pytest.raises(ConfigError, match="canary_design"):
        _config(canary_design="nope")
    # null: the longest secret that fits, up to 16 (a short sequence length no longer refuses the default)
    cfg = _config()
    seq = cfg["tokenizer"]["sequence_length"]
    assert cfg["audit"]["secret_length"] is None and cfg["audit"]["prefix_length"] == 8
    assert cfg["audit"]["canary_design"] == "new_token" and cfg["audit"]["delta"] is None
    assert canaries_lib.resolved_secret_length(cfg) == min(16, seq - 2 - 8)
    short = json.loads(json.dumps(cfg))
    short["tokenizer"]["sequence_length"] = 12
    assert canaries_lib.resolved_secret_length(short) == 2
    short["audit"]["prefix_length"] = 0
    assert canaries_lib.resolved_secret_length(short) == 10
    with pytest.raises(ConfigError, match="audit.datasets"):
        _config(datasets=["nope"])
    with pytest.raises(ConfigError, match="audit.budget"):
        _config(budget={"compute": 5, "steps": 10})
    with pytest.raises(ConfigError, match="audit"):
        _config(canaries=1)


def test_audit_cells_and_targets():
    from userdp.plotting.registry import figure_targets

    cfg = load_config("config/config.yaml")
    cells = list(grid.audit_cells(cfg))
    assert {(c.method, c.epsilon) for c in cells} == {("els", 8.0), ("uls", 8.0), ("els", float("inf")),
                                                      ("uls", float("inf"))}
    b0 = cfg["grid"]["budgets"][0]  # audit.budget null: the grid's first budget
    assert cfg["audit"]["budget"] is None
    assert {(c.dataset, c.compute, c.steps, c.seed) for c in cells} == {
        ("synth", b0["compute"], b0["steps"], cfg["audit"]["seed"])}
    assert all(not f.startswith("results/figures/audit") for f in figure_targets(cfg))  # not in rule all
    assert figure_targets(cfg, family="audit") == ["results/figures/audit_epsilon_synth.png",
                                                   "results/figures/audit_epsilon_synth.pdf"]
    assert grid.audited_datasets(cfg) == ["synth"]  # its files: tests/test_rules.py
    nulls = copy.deepcopy(cfg)
    nulls["audit"].update(epsilons=None, budget={"compute": 500, "steps": 5}, nonprivate=False)
    assert [(c.epsilon, c.compute, c.steps) for c in grid.audit_cells(nulls) if c.method == "els"] == [
        (float(e), 500, 5) for e in cfg["grid"]["epsilons"]]


def test_audit_keeps_a_seeded_subset_of_whole_train_users(tmp_path):
    tokens = tokens_table(60, seed=0, vocab=40).replace_schema_metadata({"userdp": json.dumps(META)})
    pq.write_table(tokens, tmp_path / "tokens.parquet")
    can = canaries_lib.make_canaries(canaries_lib.CanarySpec(6, 2, 3, 0), META, 0, "d")
    split = dict(zip(tokens["user_id"].to_pylist(), tokens["split"].to_pylist()))
    train_users = sorted(u for u, s in split.items() if s == "train")
    kept = {}
    for seed in (1, 2):
        info = canaries_lib.write_audit_tokens(tmp_path / "tokens.parquet", can, tmp_path / f"a{seed}.parquet",
                                               max_train_users=10, seed=seed, batch_rows=5)
        out = pq.read_table(tmp_path / f"a{seed}.parquet")
        users = {u for u in out["user_id"].to_pylist() if not u.startswith(canaries_lib.CANARY_PREFIX)}
        assert len(users) == 10 == info["dataset_train_users"] and users <= set(train_users)
        n_rows = {u: sum(1 for x in tokens["user_id"].to_pylist() if x == u) for u in users}
        assert info["dataset_train_rows"] == sum(n_rows.values())  # whole users
        kept[seed] = users
    assert kept[1] != kept[2]
    again = canaries_lib.kept_train_users(tmp_path / "tokens.parquet", 10, 1, batch_rows=3)
    assert set(again.to_pylist()) == kept[1]  # the choice does not depend on the batching
    assert canaries_lib.kept_train_users(tmp_path / "tokens.parquet", len(train_users), 1) is None


def test_audit_plans_use_the_grid_delta():
    from userdp.evaluation.audit_targets import grid_delta

    privacy, rule = grid_delta({"delta": None, "delta_exponent": 1.1}, {"n_users": {"train": 16000}})
    assert privacy["delta"] == pytest.approx(16000 ** -1.1) and "N = 16000" in rule
    assert grid_delta({"delta": 1e-7}, {"n_users": {"train": 10}}) == ({"delta": 1e-7}, "privacy.delta")


def _corpus_tables(tmp_path):
    """Two token tables whose rows use tokens 3..12 only, with known bigrams."""
    rows_a = [[1, 3, 4, 5, 2], [1, 6, 7, 2]]
    rows_b = [[1, 8, 9, 10, 11, 12, 2], [5, 3]]
    paths = []
    for name, rows in (("a", rows_a), ("b", rows_b)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path)
        paths.append(path)
    return paths, rows_a + rows_b


def test_corpus_stats_count_tokens_and_in_row_bigrams(tmp_path):
    paths, rows = _corpus_tables(tmp_path)
    stats = canaries_lib.corpus_stats(paths, 40, batch_rows=1)
    flat = [t for r in rows for t in r]
    assert stats.counts.tolist() == np.bincount(flat, minlength=40).tolist()
    pairs = {(a, b) for r in rows for a, b in zip(r[:-1], r[1:])}
    assert set(stats.bigrams.tolist()) == {a * 40 + b for a, b in pairs}
    assert stats.has_bigram(3, 4) and stats.has_bigram(5, 3) and not stats.has_bigram(2, 1)  # 2 -> 1 spans rows
    assert stats.has_bigram(np.array([6, 7]), np.array([7, 6])).tolist() == [True, False]
    with pytest.raises(DataError, match="outside the vocabulary"):
        canaries_lib.corpus_stats(paths, 10)


def test_new_token_and_rare_bigram_canaries_follow_their_design(tmp_path):
    paths, _ = _corpus_tables(tmp_path)
    stats = canaries_lib.corpus_stats(paths, 40)
    seen = set(np.flatnonzero(stats.counts).tolist()) - {0, 1, 2}
    new = canaries_lib.make_canaries(canaries_lib.CanarySpec(300, 2, 5, 0, "new_token", 3, 7), META, 0, "d", stats)
    secrets, prefixes = np.array(new["secret"].to_pylist()), np.array(new["prefix"].to_pylist())
    assert set(secrets.ravel().tolist()) == set(range(3, 40)) - seen  # every unseen non-special token, only those
    assert set(prefixes.ravel().tolist()) <= seen  # the prefix is in-distribution
    assert all(s == [1, *p, *sec, 2] for s, p, sec in zip(new["input_ids"].to_pylist(), prefixes.tolist(),
                                                          secrets.tolist()))
    cand = np.array(new["candidates"].to_pylist())
    assert cand.shape == (300, 7, 5) and set(cand.ravel().tolist()) <= set(range(3, 40)) - seen
    assert set(new["design"].to_pylist()) == {"new_token"}

    big = canaries_lib.make_canaries(canaries_lib.CanarySpec(300, 2, 6, 0, "rare_bigram", 2, 4), META, 0, "d", stats)
    secrets, prefixes = np.array(big["secret"].to_pylist()), np.array(big["prefix"].to_pylist())
    assert set(secrets.ravel().tolist()) <= seen and set(prefixes.ravel().tolist()) <= seen
    chain = np.concatenate([prefixes[:, -1:], secrets], axis=1)  # the prefix's last token -> the first secret token
    assert not stats.has_bigram(chain[:, :-1], chain[:, 1:]).any()
    cand = np.array(big["candidates"].to_pylist())
    cchain = np.concatenate([np.repeat(prefixes[:, -1:], 4, axis=0), cand.reshape(-1, 6)], axis=1)
    assert not stats.has_bigram(cchain[:, :-1], cchain[:, 1:]).any()
    # the coins do not depend on the design; the candidates do not change the canaries
    assert big["included"].equals(new["included"])
    again = canaries_lib.make_canaries(canaries_lib.CanarySpec(300, 2, 6, 0, "rare_bigram", 2, 0), META, 0, "d", stats)
    assert again["secret"].equals(big["secret"]) and again["prefix"].equals(big["prefix"])


def test_designs_that_cannot_be_built_are_refused_with_the_fix(tmp_path):
    rows = [list(range(3, 40)) + [3]]  # every non-special token occurs
    path = tmp_path / "all.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path)
    stats = canaries_lib.corpus_stats([path], 40)
    with pytest.raises(ConfigError, match="canary_design new_token.*rare_bigram"):
        canaries_lib.make_canaries(canaries_lib.CanarySpec(10, 1, 4, 0, "new_token", 2), META, 0, "d", stats)
    with pytest.raises(ConfigError, match="canary_design"):
        canaries_lib.CanarySpec(10, 1, 4, 0, "bogus")
    with pytest.raises(ValueError, match="corpus"):
        canaries_lib.make_canaries(canaries_lib.CanarySpec(10, 1, 4, 0, "rare_bigram", 2), META, 0, "d")
