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
from userdp import layout
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
    with pytest.raises(ConfigError, match="audit.secret_length"):
        _config(secret_length=23)
    _config(secret_length=22)
    # null: the longest secret that fits, up to 16 (a short sequence length no longer refuses the default)
    cfg = _config()
    seq = cfg["tokenizer"]["sequence_length"]
    assert cfg["audit"]["secret_length"] is None
    assert canaries_lib.resolved_secret_length(cfg) == min(16, seq - 2)
    short = json.loads(json.dumps(cfg))
    short["tokenizer"]["sequence_length"] = 12
    assert canaries_lib.resolved_secret_length(short) == 10
    with pytest.raises(ConfigError, match="audit.datasets"):
        _config(datasets=["nope"])
    with pytest.raises(ConfigError, match="audit.budget"):
        _config(budget={"compute": 5, "steps": 10})
    with pytest.raises(ConfigError, match="audit"):
        _config(canaries=1)


def test_audit_cells_and_targets():
    from userdp.evaluation.audit_targets import audit_targets, result_files
    from userdp.plotting.registry import figure_targets

    cfg = load_config("config/config.yaml")
    cells = list(layout.audit_cells(cfg))
    assert {(c.method, c.epsilon) for c in cells} == {("els", 8.0), ("uls", 8.0), ("els", float("inf")),
                                                      ("uls", float("inf"))}
    b0 = cfg["grid"]["budgets"][0]  # audit.budget null: the grid's first budget
    assert cfg["audit"]["budget"] is None
    assert {(c.dataset, c.compute, c.steps, c.seed) for c in cells} == {
        ("synth", b0["compute"], b0["steps"], cfg["audit"]["seed"])}
    assert all(not f.startswith("results/figures/audit") for f in figure_targets(cfg))  # not in rule all
    assert figure_targets(cfg, family="audit") == ["results/figures/audit_epsilon_synth.png",
                                                   "results/figures/audit_epsilon_synth.pdf"]
    assert audit_targets(cfg) == ["results/audit/synth/summary.parquet", "results/audit/synth/summary.csv",
                                  "results/audit/synth/table.html"]
    assert result_files(cfg, "synth")[0].startswith("results/audit/synth/scores/method~els/eps~8/budget~")
    nulls = copy.deepcopy(cfg)
    nulls["audit"].update(epsilons=None, budget={"compute": 500, "steps": 5}, nonprivate=False)
    assert [(c.epsilon, c.compute, c.steps) for c in layout.audit_cells(nulls) if c.method == "els"] == [
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
