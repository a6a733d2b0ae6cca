"""The plan rules run by the real `snakemake` on a tiny config in a temporary folder.

The data stage's outputs (users.parquet, contributions.json) are written as a
fixture, and a Snakefile with only common.smk and plan.smk (the same rules
and scripts as the pipeline) runs, so this test exercises the plan stage alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]

TINY = """\
seed: 0
datasets:
  tiny: {source: synthetic}
grid:
  datasets: [tiny]
  methods: [els, uls]
  epsilons: [2]
  budgets: [{compute: 600, steps: 20}]
  nonprivate: true
  group_size_sweep: [2]
privacy:
  comparison: {sampling_rate: 0.05, steps: 20, delta: 1.0e-5, epsilons: [2, 8], group_sizes: [1, 4]}
training:
  learning_rates: [0.001, 0.01]
"""

SNAKEFILE = """\
from snakemake.utils import validate
configfile: "config/config.yaml"
include: "workflow/rules/common.smk"
validate(config, "workflow/schemas/config.schema.yaml")
include: "workflow/rules/plan.smk"
include: "workflow/rules/figures.smk"
"""


def write_fixture_data(root: Path) -> np.ndarray:
    rng = np.random.default_rng(1)
    n = 400
    counts = np.clip(np.round(np.exp(rng.normal(np.log(3), 0.8, n))), 1, 20).astype(int)
    split = np.where(np.arange(n) < 320, "train", np.where(np.arange(n) < 360, "validation", "test"))
    d = root / "results" / "data" / "tiny"
    d.mkdir(parents=True)
    pd.DataFrame({"user_id": [f"u{i:04d}" for i in range(n)], "split": split, "n_examples": counts}).to_parquet(
        d / "users.parquet", index=False
    )
    train = counts[split == "train"]
    (d / "contributions.json").write_text(json.dumps({
        "n_users": {s: int((split == s).sum()) for s in ("train", "validation", "test")},
        "n_examples": {"train": int(train.sum())},
        "median_train": float(np.median(train)), "max_train": int(train.max()), "quantiles_train": {}, "dropped": {},
    }))
    return train


def test_plan_rules_produce_the_plans(tmp_path):
    os.symlink(REPO / "workflow", tmp_path / "workflow")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(TINY)
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    train = write_fixture_data(tmp_path)
    base = "results/plan/tiny"
    plans = [f"{base}/method~{m}/eps~{e}/budget~600.json" for m in ("els", "uls") for e in ("2", "inf")]
    plans += [f"{base}/method~{m}/eps~2/budget~600/group~2.json" for m in ("els", "uls")]
    targets = plans + ["results/accounting/comparison.parquet", "results/figures/noise_vs_group_size.png"]
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--nolock", *targets],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    for path in plans:
        plan = json.loads((tmp_path / path).read_text())
        assert plan["expected_compute"] == pytest.approx(600)
        assert plan["n_train_users"] == train.size
        if "eps~inf" in path:
            assert plan["noise_multiplier"] == 0 and plan["epsilon"] == "inf" and plan["clip_norm"] is None
        else:
            assert plan["epsilon_achieved"] <= 2 and plan["noise_multiplier"] > 0
            # The target is the released model's: each of the 2 learning-rate runs gets less on its own.
            assert plan["selection"] == {"accounting": "composed", "candidates": 2}
            assert plan["epsilon_target_of"] == "released model" and plan["epsilon_per_run"] < 0.8 * 2
        if "group~2" in path:
            assert plan["group_size"] == 2
    els = json.loads((tmp_path / plans[0]).read_text())
    assert els["group_size"] == int(np.ceil(np.median(train)))
    df = pd.read_parquet(tmp_path / "results/accounting/comparison.parquet")
    assert set(df["accountant"]) == {"els", "group", "group_rdp", "uls"} and len(df) == 2 * 2 * 4
    t = df.pivot_table(index=["epsilon", "group_size"], columns="accountant", values="noise_multiplier")
    assert (t["els"] <= t["group"] * (1 + 1e-9)).all() and (t["els"] <= t["group_rdp"] * (1 + 1e-9)).all()
    assert (tmp_path / "results/figures/noise_vs_group_size.pdf").stat().st_size > 0
    assert list((tmp_path / "results/cache/accounting").glob("*.json"))  # the jobs shared the accountant memo
    assert (tmp_path / "results/logs/plan/tiny/method~els/eps~2/budget~600.log").exists()
