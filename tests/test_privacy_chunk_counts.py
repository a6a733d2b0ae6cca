"""Chunk mode: the planner counts tokens.parquet rows per train user, as the training pool does."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userdp.errors import DataError
from userdp.privacy.planner import plan_cell, read_counts, read_train_counts, read_train_token_counts
from userdp.training.pool import load_train_pool

PRIVACY = {
    "delta": None, "delta_exponent": 1.1, "clip_norm": 1.0, "clipping": "flat", "max_noise_multiplier": 500,
    "calibration_tolerance": 1e-3,
    "group_size": {"els": "median", "uls": 2, "snr_noise_ratio": 1.0, "snr_max_quantile": 0.99},
}


def write_chunked(root, n_users=300, seed=0):
    """users.parquet (examples per user) and a tokens.parquet where each example became 1-4 windows."""
    rng = np.random.default_rng(seed)
    n_ex = np.clip(np.round(np.exp(rng.normal(np.log(3), 0.7, n_users))), 1, 30).astype(int)
    split = np.where(np.arange(n_users) < 240, "train", np.where(np.arange(n_users) < 270, "validation", "test"))
    users = pd.DataFrame({"user_id": [f"u{i:04d}" for i in range(n_users)], "split": split, "n_examples": n_ex})
    users.to_parquet(root / "users.parquet", index=False)
    rows = {"user_id": [], "example_id": [], "split": [], "input_ids": []}
    ex = 0
    for u in rng.permutation(n_users):  # rows not grouped by user: counts must be merged across batches
        for _ in range(n_ex[u]):
            for _ in range(int(rng.integers(1, 5))):
                rows["user_id"].append(f"u{u:04d}")
                rows["example_id"].append(ex)
                rows["split"].append(split[u])
                rows["input_ids"].append([1, 5, 6, 2])
                ex += 1
    table = pa.table({"user_id": rows["user_id"], "example_id": pa.array(rows["example_id"], pa.int64()),
                      "split": rows["split"], "input_ids": pa.array(rows["input_ids"], pa.list_(pa.int32()))})
    pq.write_table(table, root / "tokens.parquet", row_group_size=500)
    per_user = pd.Series(rows["user_id"])[np.asarray(rows["split"]) == "train"].value_counts()
    return users, per_user


def test_token_counts_stream_and_match_rows(tmp_path):
    users, per_user = write_chunked(tmp_path)
    got = read_train_token_counts(str(tmp_path / "tokens.parquet"), batch_rows=97)  # many partial merges
    assert sorted(got.tolist()) == sorted(per_user.tolist())
    ex_counts = read_train_counts(str(tmp_path / "users.parquet"))
    assert got.sum() > ex_counts.sum() and got.size == ex_counts.size  # chunking made the counts differ
    counts, source = read_counts(tokens=str(tmp_path / "tokens.parquet"))
    assert "tokens.parquet" in source and sorted(counts.tolist()) == sorted(got.tolist())
    with pytest.raises(DataError, match="does not exist"):
        read_train_token_counts(str(tmp_path / "missing.parquet"))


@pytest.mark.integration
@pytest.mark.parametrize("method", ["els", "uls"])
def test_plan_from_rows_matches_the_pool(tmp_path, method):
    write_chunked(tmp_path)
    tokens = str(tmp_path / "tokens.parquet")
    rows, _ = read_counts(tokens=tokens)
    examples, _ = read_counts(users=str(tmp_path / "users.parquet"))
    K, T = 2000, 20
    plan = plan_cell(dataset="d", method=method, epsilon=8.0, compute_budget=K, steps=T, counts=rows, privacy=PRIVACY)
    old = plan_cell(dataset="d", method=method, epsilon=8.0, compute_budget=K, steps=T, counts=examples,
                    privacy=PRIVACY)
    pool = load_train_pool(tokens, plan.group_size, seed=0)
    # N_G, mbar_G and the derived batch are those of the pool training will build.
    assert plan.n_train_examples_bounded == pool.n_examples
    assert plan.n_train_examples == int(rows.sum())
    assert plan.mean_bounded_contribution == pytest.approx(pool.n_examples / pool.n_users)
    if method == "els":
        assert plan.sampling_rate == pytest.approx(K / T / pool.n_examples)
        assert plan.group_size == int(np.ceil(np.median(rows)))
        assert plan.group_size != old.group_size  # the median moved with chunking
    else:
        assert plan.expected_batch == pytest.approx(K / (T * pool.n_examples / pool.n_users))
        assert plan.expected_batch != pytest.approx(old.expected_batch)
    assert plan.expected_compute == pytest.approx(K)
