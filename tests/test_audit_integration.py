"""The user-level membership audit on a tiny model, through the pipeline's own stages (no Snakemake).

Canaries from userdp.data.canaries, the plan from the planner (plan_cell, the
real calibration), the run from rule finetune's job (finetune_job.run_job ->
engine.train), the scores and bound from userdp.evaluation.audit: for ELS,
ULS and both non-private references. The expected outcome (docs/audits.md,
"Auditing the released model"): the references leak measurably (AUC well
above 1/2, a lower bound clearly above 0 and above the private cells' claim,
so a private cell leaking like them would fail here), and no private cell's
lower bound exceeds its claimed epsilon. The rules' wiring is checked by a
Snakemake dry run of the `audit` target.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from train_fixtures import make_tokenizer, tokens_table
from userdp import grid, layout
from userdp.config import validate_config
from userdp.io import read_json

REPO = Path(__file__).resolve().parents[1]
SEQ = 12
CLAIM = 1.0

CONFIG = {
    "seed": 0,
    "datasets": {"tiny": {"source": "synthetic", "split": {"validation": 0.2, "test": 0.1}}},
    "tokenizer": {"sequence_length": SEQ, "public_dataset": "tiny", "vocab_size": 300},
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2},
    "privacy": {"delta": 1e-6},
    "grid": {"datasets": ["tiny"], "methods": ["els", "uls"], "epsilons": [CLAIM],
             "budgets": [{"compute": 1200, "steps": 30}]},
    "training": {"learning_rates": [0.01], "physical_batch_size": 32, "threads": 1, "device": "cpu"},
    "audit": {"epsilons": [CLAIM], "budget": {"compute": 1200, "steps": 30}, "canaries": 128,
              "examples_per_canary": 4, "secret_length": 8, "guess_fractions": [0.25, 0.5],
              # the random tokens of tokens_table use nearly every token: rare_bigram is the design that fits
              "canary_design": "rare_bigram", "prefix_length": 2, "exposure_candidates": 31},
}


def _tokens_with_meta(path: Path, vocab: int, ids: dict) -> None:
    table = tokens_table(80, seed=3, vocab=vocab, max_len=SEQ)
    meta = {"vocab_size": vocab, **ids, "sequence_length": SEQ, "long_examples": "truncate"}
    pq.write_table(table.replace_schema_metadata({"userdp": json.dumps(meta)}), path)


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    from userdp.data import canaries as canaries_lib
    from userdp.evaluation import audit, audit_targets
    from userdp.privacy.planner import plan_cell, read_train_token_counts
    from userdp.training import finetune_job, models

    root = tmp_path_factory.mktemp("audit")
    cfg = validate_config(json.loads(json.dumps(CONFIG)))
    vocab = make_tokenizer(root / "tokenizer")
    ids = models.special_ids(models.load_tokenizer(root / "tokenizer"))
    tokens = root / "tokens.parquet"
    _tokens_with_meta(tokens, vocab, ids)
    base = models.build_model(cfg["model"], vocab, SEQ, ids, seed=0)
    base.save_pretrained(root / "base")

    spec = canaries_lib.CanarySpec.from_config(cfg)
    meta = canaries_lib.tokens_meta(pq.read_schema(tokens), str(tokens))
    corpus = canaries_lib.corpus_stats([tokens], int(meta["vocab_size"]))
    canaries = canaries_lib.make_canaries(spec, meta, cfg["seed"], "tiny", corpus)
    pq.write_table(canaries, root / "canaries.parquet")
    audit_tokens = root / "audit_tokens.parquet"
    counts_info = canaries_lib.write_audit_tokens(tokens, canaries, audit_tokens)
    counts = read_train_token_counts(str(audit_tokens))
    privacy_delta, rule = audit_targets.grid_delta(dict(cfg["privacy"]), {"n_users": {"train": 56}})
    assert privacy_delta["delta"] == 1e-6 and rule == "privacy.delta"

    results = {}
    for cell in grid.audit_cells(cfg):
        eps = layout.fmt_num(cell.epsilon)
        plan = plan_cell(dataset="tiny", method=cell.method, epsilon=cell.epsilon, compute_budget=cell.compute,
                         steps=cell.steps, counts=counts, privacy=audit_targets.plan_privacy(cfg, cell.method, eps),
                         reference_epsilon=audit_targets.reference_epsilon(cfg, cell.method, eps))
        plan_path = root / f"plan_{cell.method}_{eps}.json"
        plan.write(plan_path)
        run_dir = root / f"run_{cell.method}_{eps}"
        job = finetune_job.FinetuneJob(
            config=cfg, plan=str(plan_path), tokens=str(audit_tokens), tokenizer=str(root / "tokenizer"),
            model=str(root / "base"), run_dir=str(run_dir), learning_rate=grid.audit_learning_rate(cfg),
            dataset="tiny", method=cell.method, eps=eps, budget=str(cell.compute), seed=cell.seed)
        finetune_job.run_job(job)
        results[(cell.method, eps)] = audit.audit_cell(
            dataset="tiny", model=str(run_dir / "model"), reference=str(root / "base"), local_reference=True,
            ledger=read_json(run_dir / "ledger.json"), canaries=str(root / "canaries.parquet"),
            scores_out=str(root / f"scores_{cell.method}_{eps}.parquet"),
            result_out=str(root / f"result_{cell.method}_{eps}.json"), confidence=cfg["audit"]["confidence"],
            guess_fractions=cfg["audit"]["guess_fractions"], batch_size=64, device="cpu")
    return {"root": root, "results": results, "counts": counts_info, "canaries": canaries, "config": cfg}


@pytest.mark.integration
def test_canaries_are_in_the_training_table_iff_their_coin_says_so(audited):
    canaries, info = audited["canaries"], audited["counts"]
    table = pq.read_table(audited["root"] / "audit_tokens.parquet")
    users = set(table["user_id"].to_pylist())
    inc = canaries["included"].to_pylist()
    assert 0 < sum(inc) < len(inc) and info["canaries_included"] == sum(inc)
    for uid, included, seq in zip(canaries["user_id"].to_pylist(), inc, canaries["input_ids"].to_pylist()):
        assert (uid in users) == included
        if included:
            rows = table.filter(table["user_id"].to_pandas().eq(uid).to_numpy())
            assert rows.num_rows == 4 and all(r == seq for r in rows["input_ids"].to_pylist())
    assert set(table["split"].to_pylist()) == {"train"}
    assert len(set(table["example_id"].to_pylist())) == table.num_rows


@pytest.mark.integration
def test_audit_outcome_references_leak_and_no_private_cell_exceeds_its_claim(audited):
    results = audited["results"]
    assert set(results) == {("els", "1"), ("uls", "1"), ("els", "inf"), ("uls", "inf")}
    for (method, eps), r in results.items():
        ledger = read_json(audited["root"] / f"run_{method}_{eps}" / "ledger.json")
        assert r["epsilon_claimed"] == (math.inf if eps == "inf" else pytest.approx(ledger["epsilon"]))
        assert r["canaries"] == 128 and r["delta"] == 1e-6 and r["canary_design"] == "rare_bigram"
        # the audit can show more than the private claim: a private cell leaking like a reference would fail
        assert r["epsilon_lower_bound_ceiling"] > 2 * CLAIM
        assert r["epsilon_lower_bound"] <= r["epsilon_lower_bound_ceiling"]
        assert r["epsilon_lower_bound_fdp"] <= r["epsilon_lower_bound_fdp_ceiling"]
        assert r["epsilon_lower_bound_fdp_ceiling"] > r["epsilon_lower_bound_ceiling"]
        assert r["exposure_max"] == 5.0 and r["exposure_candidates"] == 31
        if eps == "inf":
            assert r["loss_auc"] > 0.8 and r["likelihood_ratio_auc"] > 0.8, r
            assert r["epsilon_lower_bound"] > 1.5 * CLAIM, r
            assert r["epsilon_lower_bound_fdp"] >= r["epsilon_lower_bound"], r  # the tighter estimator
            assert r["exposure_included_mean"] > r["exposure_excluded_mean"] + 1.0, r
        else:
            assert r["epsilon_claimed"] <= CLAIM * (1 + 1e-9)
            assert r["epsilon_lower_bound"] <= r["epsilon_claimed"], r
            assert r["epsilon_lower_bound_fdp"] <= r["epsilon_claimed"], r
            assert not r["bound_exceeds_claim"] and not r["fdp_bound_exceeds_claim"]
    scores = pq.read_table(audited["root"] / "scores_els_inf.parquet").to_pandas()
    assert list(scores.columns) == ["user_id", "included", "loss", "reference_loss", "score_loss",
                                    "score_likelihood_ratio", "exposure", "extracted"]
    assert (scores["score_loss"] == -scores["loss"]).all()
    assert scores.loc[scores["included"], "loss"].mean() < scores.loc[~scores["included"], "loss"].mean()
    assert not scores.loc[~scores["included"], "extracted"].any()  # an unseen secret is not decoded by chance


@pytest.mark.integration
def test_audit_target_wiring_dry_run(tmp_path):
    """`snakemake -n audit` on the default config: canaries, plans, runs, scores, summary, figure."""
    cmd = [sys.executable, "-m", "snakemake", "-n", "audit", "-s", str(REPO / "Snakefile"), "--directory",
           str(tmp_path), "--configfile", str(REPO / "config/config.yaml"), "--cores", "1", "--quiet", "rules"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    assert counts.get("audit_canaries") == 1 and counts.get("audit_summary") == 1
    assert counts.get("audit_plan") == counts.get("audit_finetune") == counts.get("audit_score") == 4
    assert counts.get("plot_audit_epsilon") == 1 and counts.get("audit") == 1
    assert "finetune" not in counts and "select_lr" not in counts  # the audit trains only its own runs
