"""Evaluation metrics: hand-computed reference, padding invariance, held-out users only."""

import math

import pytest
import torch

from eval_builders import tiny_gpt2, tokens_table
from userdp.errors import DataError
from userdp.evaluation.metrics import (
    choose_users,
    evaluate_models,
    evaluate_set,
    load_eval_set,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaldata")
    df = tokens_table(d / "tokens.parquet")
    model = tiny_gpt2(d / "model")
    return d, df, model


def hand_metrics(model, eval_set):
    """One sequence at a time, log-softmax and averages written out by hand."""
    nll_by_user, n_by_user = {}, {}
    total_nll, total_n, total_hits = 0.0, 0, 0
    for user, seq in zip(eval_set.user_ids, eval_set.sequences):
        if len(seq) < 2:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(seq)[None]).logits[0].double()
        for t in range(len(seq) - 1):
            row = logits[t]
            m = row.max()
            log_z = m + torch.log(torch.exp(row - m).sum())
            nll = float(log_z - row[seq[t + 1]])
            total_nll += nll
            total_n += 1
            total_hits += int(int(row.argmax()) == int(seq[t + 1]))
            nll_by_user[user] = nll_by_user.get(user, 0.0) + nll
            n_by_user[user] = n_by_user.get(user, 0) + 1
    per_user = [nll_by_user[u] / n_by_user[u] for u in nll_by_user]
    return {
        "loss": total_nll / total_n,
        "loss_user_macro": sum(per_user) / len(per_user),
        "accuracy": total_hits / total_n,
        "n_tokens": total_n,
        "n_users": len(per_user),
    }


@pytest.mark.parametrize("split", ["validation", "test"])
def test_metrics_match_hand_computation(data, split):
    d, df, model = data
    es = load_eval_set(d / "tokens.parquet", split, None, seed=0)
    got = evaluate_set(model, es, batch_size=3, device="cpu")
    ref = hand_metrics(model, es)
    assert got["n_tokens"] == ref["n_tokens"] == int((df[df.split == split].n_tokens - 1).sum())
    assert got["n_users"] == ref["n_users"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["loss_user_macro"] == pytest.approx(ref["loss_user_macro"], rel=1e-5)
    # the macro average differs from the micro average on this data (users have different token counts)
    assert abs(got["loss_user_macro"] - got["loss"]) > 1e-6
    assert got["accuracy"] == pytest.approx(ref["accuracy"])
    assert got["perplexity"] == pytest.approx(math.exp(ref["loss"]), rel=1e-5)
    # a random model is near the uniform loss log(V)
    assert abs(got["loss"] - math.log(model.config.vocab_size)) < 0.5


def test_padding_and_batching_do_not_change_metrics(data):
    d, _, model = data
    es = load_eval_set(d / "tokens.parquet", "test", None, seed=0)
    assert len({len(s) for s in es.sequences}) > 2  # lengths really differ, so batches are padded
    results = [evaluate_set(model, es, batch_size=b, device="cpu") for b in (1, 2, 5, 1000)]
    for r in results[1:]:
        for k in ("loss", "loss_user_macro", "accuracy"):
            assert r[k] == pytest.approx(results[0][k], rel=1e-5, abs=1e-7)
        assert r["n_tokens"] == results[0]["n_tokens"]


def test_evaluation_reads_only_held_out_users(data):
    d, df, _ = data
    train_users = set(df[df.split == "train"].user_id)
    for split in ("validation", "test"):
        es = load_eval_set(d / "tokens.parquet", split, None, seed=0)
        assert set(es.user_ids) == set(es.users) == set(df[df.split == split].user_id)
        assert not set(es.user_ids) & train_users
        assert len(es.sequences) == int((df.split == split).sum())
    with pytest.raises(ValueError, match="train"):
        load_eval_set(d / "tokens.parquet", "train", None, seed=0)


def test_users_in_two_splits_are_refused(tmp_path):
    df = tokens_table(tmp_path / "tokens.parquet")
    leaked = df[df.split == "train"].user_id.iloc[0]
    df.loc[df.index[-1], "user_id"] = leaked  # a train user also has a test row
    bad = tmp_path / "bad.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), bad)
    load_eval_set(tmp_path / "tokens.parquet", "test", None, seed=0)
    with pytest.raises(DataError, match=f"also have rows in split.*train.*{leaked}"):
        load_eval_set(bad, "test", None, seed=0)
    load_eval_set(bad, "validation", None, seed=0)  # the validation users are still clean


def test_user_cap_is_seeded_and_exact():
    users = [f"u{i}" for i in range(100)] * 3
    a = choose_users(users, 10, seed=1)
    assert len(a) == 10 and a == sorted(a) and set(a) <= set(users)
    assert choose_users(users, 10, seed=1) == a
    assert choose_users(users, 10, seed=2) != a
    assert choose_users(users, None, seed=1) == sorted(set(users))
    assert choose_users(users, 1000, seed=1) == sorted(set(users))


def test_evaluate_models_end_to_end(data):
    d, df, _ = data
    [out] = evaluate_models([d / "model"], d / "tokens.parquet", dataset="toy", root_seed=0, max_users=2,
                            batch_size=4, device="cpu")
    for split in ("validation", "test"):
        assert out[f"{split}_n_users"] == 2
        assert 0 < out[f"{split}_loss"] < 10
        assert 0 <= out[f"{split}_accuracy"] <= 1
    [again] = evaluate_models([d / "model"], d / "tokens.parquet", dataset="toy", root_seed=0, max_users=2,
                              batch_size=1, device="cpu")
    assert again["test_loss"] == pytest.approx(out["test_loss"], rel=1e-6)
    with pytest.raises(DataError, match="config.json"):
        evaluate_models([d / "missing"], d / "tokens.parquet", dataset="toy", root_seed=0, max_users=2,
                        batch_size=4, device="cpu")


def test_test_split_only_scores_the_same_users_and_no_validation(data):
    d, _, _ = data
    opts = dict(dataset="toy", root_seed=0, max_users=2, batch_size=4, device="cpu")
    both = evaluate_models([d / "model"], d / "tokens.parquet", **opts)[0]
    test_only = evaluate_models([d / "model"], d / "tokens.parquet", splits=["test"], **opts)[0]
    assert not any(k.startswith("validation_") for k in test_only)
    assert {k: v for k, v in both.items() if k.startswith("test_")} == \
        {k: v for k, v in test_only.items() if k.startswith("test_")}
    assert test_only["evaluation"]["splits"] == ["test"] and both["evaluation"]["splits"] == ["validation", "test"]
    for bad in ([], ["train"], ["test", "test"]):
        with pytest.raises(ValueError, match="splits"):
            evaluate_models([d / "model"], d / "tokens.parquet", splits=bad, **opts)


def test_validation_is_scored_only_where_a_choice_reads_it():
    from userdp.evaluation.targets import evaluated_splits

    auto, always = {"evaluation": {"validation": "auto"}}, {"evaluation": {"validation": "always"}}
    assert evaluated_splits(auto, selects=False) == ["test"]
    assert evaluated_splits(auto, selects=True) == ["validation", "test"]
    assert evaluated_splits(always, selects=False) == ["validation", "test"]
