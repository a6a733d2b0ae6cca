"""With DP contribution statistics no artifact or log holds an exact statistic of the train users' counts.

A real Snakemake run of the pipeline (tests/configs/tiny.yaml with
`privacy.contribution_stats.private: true`, counts made distinctive: median
~130, heavy tails up to a cap of 437) builds the data, the DP release, the ELS and ULS plans,
both fine-tuning runs and the contributions figure. Every file under
results/ (results/logs/ included) is then scanned (tests/leak_scan.py) for the
exact total, maximum, medians, quantiles, histogram, users per count, and
for every G the pool size N_G, mbar_G and the sampling rates they would
give, computed here from the data. The summary row of each cell (what
rule aggregate writes) is built from the run's plan and ledger and scanned too.

Left out of the scan, by documented decision (docs/privacy.md, "What is
treated as public"): the private data itself (examples.parquet,
users.parquet, tokens.parquet: the users' rows, which are never published)
and what is built from public text only (public.parquet,
public_tokens.parquet, the tokenizer), and model weights (binary).

The scanner is checked on the same data: the artifacts of the default mode
(contributions.json, a plan and the figure from the exact counts) must be
flagged, so a scan that finds nothing means something.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from leak_scan import exact_statistics, file_values, find_leaks, leaks_in

from userdp import grid, layout
from userdp.privacy.spec import RunSpec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
K, T, LR = 64, 2, 0.003
CELLS = [grid.Cell("tiny", m, 4.0, K, T, 0) for m in ("els", "uls")]


def _config() -> dict:
    config = yaml.safe_load((REPO / "tests" / "configs" / "tiny.yaml").read_text())
    config["datasets"]["tiny"]["synthetic"].update(
        n_users=60, contributions_median=130, contributions_sigma=1.5, max_contributions=437, public_examples=400)
    config["model"]["pretrain"]["steps"] = 2
    config["privacy"]["contribution_stats"] = {"private": True, "epsilon": 0.5}
    # ELS with an explicit G keeps the mixture-of-Gaussians accountant cheap; ULS keeps the SNR rule (its
    # candidate table is read from the release).
    config["privacy"]["group_size"] = {"els": 32, "uls": "snr", "snr_max_quantile": 0.5}
    config["grid"].update(methods=["els", "uls"], epsilons=[4], budgets=[{"compute": K, "steps": T}], nonprivate=False)
    config["training"].update(learning_rates=[LR], uls_examples_per_user=4, physical_batch_size=128)
    return config


def _targets() -> list[str]:
    out = [layout.CONTRIBUTIONS.format(dataset="tiny"), layout.CONTRIBUTIONS_DP.format(dataset="tiny"),
           "results/figures/contributions_tiny.png", "results/figures/contributions_tiny.pdf"]
    for cell in CELLS:
        out += [cell.plan_path, f"{cell.lr_dir(LR)}/{layout.LEDGER}"]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_stats_run")
    (root / "config.yaml").write_text(yaml.safe_dump(_config()))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(root),
           "--configfile", str(root / "config.yaml"), "--replace-workflow-config", "--cores", "2", *_targets()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        pytest.fail(f"snakemake failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return root


def _train_counts(root: Path) -> np.ndarray:
    users = pq.read_table(root / layout.USERS.format(dataset="tiny")).to_pandas()
    return users.loc[users["split"] == "train", "n_examples"].to_numpy()


def _targets_of(root: Path):
    counts = _train_counts(root)
    contributions = json.loads((root / layout.CONTRIBUTIONS.format(dataset="tiny")).read_text())
    # The synthetic cap (max_contributions) is a config value: a maximum at the cap is public, and a held-out user
    # at the cap (eval_users.parquet holds the test users' own counts) is no leak.
    cap = _config()["datasets"]["tiny"]["synthetic"]["max_contributions"]
    public = [counts.size, K, T, K / T, cap, *contributions["n_users"].values()]
    return counts, exact_statistics(counts, public, [(K, T)])


def _excluded(root: Path) -> list[Path]:
    d = {"dataset": "tiny"}
    private_data = [layout.EXAMPLES, layout.USERS, layout.TOKENS]
    public_only = [layout.PUBLIC, "results/data/{dataset}/public_tokens.parquet", layout.TOKENIZER,
                   "results/tokenizer/tokenizer_info.json"]
    # the jobs' benchmark files: wall times and memory, whose digits could match a statistic by chance
    return [root / p.format(**d) for p in private_data + public_only] + [root / layout.BENCHMARKS]


def test_the_counts_are_distinctive(run):
    counts, targets = _targets_of(run)
    assert counts.max() > 300 and np.median(counts) > 100  # whole-number statistics far from steps, seeds, G
    assert (counts < 32).any()  # N_G of the ELS cell's G = 32 is not N G: a statistic the plan must not hold
    assert len(targets.ints) >= 8 and len(targets.floats) >= 15 and targets.sequences


def test_no_artifact_or_log_holds_an_exact_statistic(run):
    _, targets = _targets_of(run)
    scanned = [p for p in (run / "results").rglob("*") if p.is_file()]
    assert any(p.suffix == ".log" for p in scanned) and any("plan" in str(p) for p in scanned)
    leaks = find_leaks(run / "results", targets, exclude=_excluded(run))
    assert leaks == {}, json.dumps(leaks, indent=1)


def test_summary_rows_hold_no_exact_statistic(run, tmp_path):
    from userdp.evaluation.aggregate import cell_row

    _, targets = _targets_of(run)
    for cell in CELLS:
        plan = RunSpec.load(run / cell.plan_path)
        ledger = json.loads((run / cell.lr_dir(LR) / layout.LEDGER).read_text())
        train_log = pq.read_table(run / cell.lr_dir(LR) / layout.TRAIN_LOG).to_pandas()
        row = cell_row(cell, plan, ledger, {"learning_rate": LR}, train_log)
        assert leaks_in(file_values(_dump(tmp_path / f"{cell.method}.json", row)), targets) == []


def _dump(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, default=str))
    return path


def test_plans_and_ledgers_use_only_the_release_and_n(run):
    counts = _train_counts(run)
    release = json.loads((run / layout.CONTRIBUTIONS_DP.format(dataset="tiny")).read_text())
    from userdp.privacy.contribution_stats import NoisyHistogram

    hist = NoisyHistogram.from_release(release)
    for cell in CELLS:
        plan = RunSpec.load(run / cell.plan_path)
        ledger = json.loads((run / cell.lr_dir(LR) / layout.LEDGER).read_text())
        G = plan.group_size
        assert plan.planning_sizes == "DP histogram" and plan.n_train_examples is None
        assert plan.n_train_users == counts.size
        assert plan.mean_bounded_contribution == pytest.approx(hist.mean_bounded(G), rel=1e-12)
        # Training divided by the plan's public expected batch, and wrote no exact pool size.
        assert ledger["expected_batch"] == pytest.approx(plan.expected_batch, rel=1e-12)
        assert ledger["n_pool_examples"] is None and ledger["n_examples_before_bounding"] is None
        # examples processed / (q T) would give back N_G: the realised compute is withheld too
        assert ledger["examples_processed"] is None and ledger["users_processed"] is None
        assert ledger["compute_ratio"] is None
        assert ledger["epsilon"] == pytest.approx(plan.epsilon_achieved, rel=1e-9)
        if cell.method == "uls":
            assert plan.group_size_candidates and all(
                r["mean_bounded_contribution"] == pytest.approx(hist.mean_bounded(r["group_size"]), rel=1e-12)
                for r in plan.group_size_candidates)
    contributions = json.loads((run / layout.CONTRIBUTIONS.format(dataset="tiny")).read_text())
    assert contributions["treated_as_public"] is False and "median_train" not in contributions


def test_the_scan_finds_the_statistics_of_the_default_mode(run, tmp_path):
    """Positive control: the same data's default-mode artifacts (exact counts) are flagged."""
    import pyarrow.compute as pc

    from userdp.data.prepare import contribution_stats
    from userdp.plotting.contributions import plot_contributions
    from userdp.privacy.planner import plan_cell

    counts, targets = _targets_of(run)
    users = pq.read_table(run / layout.USERS.format(dataset="tiny"))
    stats = contribution_stats(users, {}, {}, int(pc.sum(users.column("n_examples")).as_py()))
    stats_path = _dump(tmp_path / "contributions.json", stats)
    hits = leaks_in(file_values(stats_path), targets)
    # (the maximum is the public cap here, max_contributions: not a target; the total, histogram and median are)
    assert counts.max() == _config()["datasets"]["tiny"]["synthetic"]["max_contributions"]
    assert any("total examples" in h for h in hits)
    assert any("histogram" in h for h in hits) and any("median" in h for h in hits)
    plot_contributions(stats_path, tmp_path / "c.png", tmp_path / "c.pdf", dataset="tiny")
    assert any("total examples" in h for h in leaks_in(file_values(tmp_path / "c.pdf"), targets))
    privacy = {"delta_exponent": 1.1, "clip_norm": 1.0, "group_size": {"els": 32}}
    plan = plan_cell(dataset="tiny", method="els", epsilon=4.0, compute_budget=K, steps=T, counts=counts,
                     privacy=privacy)
    hits = leaks_in(file_values(_dump(tmp_path / "plan.json", plan.to_record())), targets)
    assert {"N_G, G=32", "ELS q from exact N_G, G=32, K=64"} <= {h.split(" = ")[0] for h in hits}
    log = tmp_path / "x.log"
    log.write_text(f"pool={int(np.minimum(counts, 32).sum())} examples q={plan.sampling_rate:.6g}\n")
    names = {h.split(" = ")[0] for h in leaks_in(file_values(log), targets)}
    assert {"N_G, G=32", "ELS q from exact N_G, G=32, K=64"} <= names  # the integer, and the float at 6 digits
