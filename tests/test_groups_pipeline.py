"""The real pipeline with a local dataset whose users carry a label (`datasets.<name>.group_column`).

Runs snakemake on a tiny config (a synthetic dataset for the public text and the tokenizer, a local JSON
Lines dataset in the grid) up to the group table and its figures, and checks the per-user artifact (one row
per evaluated test user and model) and the label groups; then a file whose group column varies within a user
stops the pipeline at rule user_labels with an error naming the user and the file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from userdp.data.synthetic import SyntheticSource

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "configs" / "tiny.yaml"

pytestmark = pytest.mark.integration


def write_local(path: Path, vary_user: str | None = None) -> None:
    """JSON Lines of 160 synthetic users; label "north" for even user numbers, "south" for odd ones."""
    src = SyntheticSource("gen", {"source": "synthetic", "synthetic": {
        "n_users": 160, "contributions_median": 4, "contributions_sigma": 1.0, "max_contributions": 64,
        "n_topics": 4, "public_examples": 0}}, path.parent, 0)
    lines, seen = [], set()
    for batch in src.iter_batches(1000):
        for user, text in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            label = "north" if int(user[1:]) % 2 == 0 else "south"
            if user == vary_user and user in seen:
                label = "east"
            seen.add(user)
            lines.append(json.dumps({"author": user, "body": text, "region": label}))
    path.write_text("\n".join(lines) + "\n")


def config(tmp: Path, data: Path) -> Path:
    cfg = yaml.safe_load(TINY.read_text())
    cfg["datasets"]["loc"] = {"source": "local", "path": str(data), "user_column": "author", "text_column": "body",
                              "group_column": "region", "split": {"validation": 0.15, "test": 0.25}}
    cfg["grid"]["datasets"] = ["loc"]
    cfg["evaluation"]["max_users"] = 30
    cfg["groups"] = {"min_users": 5, "bootstrap": 500}
    out = tmp / "config.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def snakemake(workdir: Path, cfg: Path, *targets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(cfg), "--replace-workflow-config", "--cores", "2", *targets]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_local_group_column_through_the_pipeline(tmp_path):
    data = tmp_path / "posts.jsonl"
    write_local(data)
    cfg = config(tmp_path, data)
    targets = ["results/summary/loc/groups.csv", "results/figures/groups_cost_loc.png",
               "results/figures/groups_gap_vs_examples_loc.png"]
    proc = snakemake(tmp_path, cfg, *targets)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    for t in targets:
        assert (tmp_path / t).stat().st_size > 0
    users = pd.read_parquet(tmp_path / "results/summary/loc/users.parquet")
    test_users = pd.read_parquet(tmp_path / "results/data/loc/users.parquet").query("split == 'test'")
    # one row per evaluated test user and model: 4 cells (ELS, ULS x eps 4, inf) and the pretrained model
    n_eval = min(30, len(test_users))
    assert users.groupby(["model", "method", "epsilon"], dropna=False).size().eq(n_eval).all()
    assert len(users) == n_eval * 5 and users["user_id"].nunique() == n_eval
    assert set(users["user_id"]) <= set(test_users["user_id"])
    # a user's label is the file's region; their example count the test split's
    assert (users["label_group"] == users["user_id"].map(
        lambda u: "north" if int(u[1:]) % 2 == 0 else "south")).all()
    counts = test_users.set_index("user_id")["n_examples"]
    assert (users["n_examples"] == users["user_id"].map(counts)).all()
    table = pd.read_csv(tmp_path / "results/summary/loc/groups.csv")
    cost = table[(table.measure == "cost") & (table.group_kind == "label")]
    assert set(cost["group"]) == {"north", "south"} and set(cost["method"]) == {"els", "uls"}
    assert set(cost["epsilon"]) == {4.0}
    for r in cost.itertuples():
        assert r.cost_low <= r.cost <= r.cost_high
        fine = users[(users.method == r.method) & (users.label_group == r.group) & (users.model == "fine-tuned")]
        gap = (fine[fine.epsilon == 4.0].set_index("user_id")["loss"]
               - fine[fine.epsilon == float("inf")].set_index("user_id")["loss"])
        assert r.cost == pytest.approx(gap.mean()) and r.n_users == len(gap)
    assert set(table["group_kind"]) == {"contribution", "label"}


def test_a_group_column_varying_within_a_user_stops_the_pipeline(tmp_path):
    data = tmp_path / "posts.jsonl"
    write_local(data, vary_user="u000003")
    cfg = config(tmp_path, data)
    proc = snakemake(tmp_path, cfg, "results/data/loc/user_labels.parquet")
    assert proc.returncode != 0
    log = (tmp_path / "results/logs/data/user_labels_loc.log").read_text()
    assert "'u000003'" in log and str(data) in log and "group_column" in log
    assert not (tmp_path / "results/data/loc/user_labels.parquet").exists()
