"""DP contribution statistics: the noisy histogram, the G rules on it, composition, calibration, ledger."""

import json
import math
import subprocess
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pandas as pd
import pytest

from userdp.errors import PrivacyError
from userdp.privacy import accounting as A
from userdp.privacy import contribution_stats as CS
from userdp.privacy.contributions import ExactCounts
from userdp.privacy.group_size import snr_group_size
from userdp.privacy.planner import plan_cell
from userdp.training.ledger import RunFacts, build_ledger

from privacy_helpers import calibrate_method, epsilon_of, mech

PRIVACY = {
    "delta": None, "delta_exponent": 1.1, "clip_norm": 1.0, "clipping": "flat", "max_noise_multiplier": 500,
    "calibration_tolerance": 1e-3,
    "group_size": {"els": "median", "uls": "snr", "snr_noise_ratio": 1.0, "snr_max_quantile": 0.99},
}
STATS_ON = {**PRIVACY, "contribution_stats": {"private": True, "epsilon": 0.2, "max_log2": 20}}


@pytest.fixture(scope="module")
def counts():
    rng = np.random.default_rng(0)
    return np.clip(np.round(np.exp(rng.normal(np.log(6), 1.0, 3001))), 1, 200).astype(int)


def noisy(counts, eps=0.2, seed=3, max_log2=20):
    return CS.NoisyHistogram.from_release(
        CS.release(counts, eps, max_log2, seed, dataset="d", source="test"), "contributions_dp.json")


# ---------------------------------------------------------------- the mechanism


def test_histogram_bins_are_powers_of_two():
    c = np.array([1, 2, 3, 4, 7, 8, 1000, 2**25])
    h = CS.histogram(c, max_log2=20)
    assert h.size == 21 and h.sum() == c.size
    assert h[0] == 1 and h[1] == 2 and h[2] == 2 and h[3] == 1 and h[9] == 1 and h[20] == 1  # last bin open


def test_laplace_noise_scale_over_many_seeds():
    c = np.repeat([1, 2, 5, 40], [50, 30, 20, 7])
    true = CS.histogram(c, 8)
    eps = 0.5
    noise = np.array([np.asarray(CS.release(c, eps, 8, s, dataset="d", source="t")["noisy_counts"]) - true
                      for s in range(1500)])
    n, b = noise.size, 1 / eps
    # Laplace(0, b): mean 0, E|X| = b, Var X = 2 b^2; 5-sigma bounds of the sample statistics.
    assert abs(noise.mean()) < 5 * math.sqrt(2) * b / math.sqrt(n)
    assert abs(np.abs(noise).mean() - b) < 5 * b / math.sqrt(n)
    assert abs(noise.var() / (2 * b * b) - 1) < 5 * math.sqrt(5) / math.sqrt(n)  # Var(X^2)/(2b^2)^2 = 5
    # Independent across bins and seeds: neighbouring bins uncorrelated.
    assert abs(np.corrcoef(noise[:, 0], noise[:, 1])[0, 1]) < 5 / math.sqrt(noise.shape[0])


def test_release_holds_no_true_counts_and_is_seeded():
    c = np.repeat([1, 4, 16], [11, 5, 3])
    rec = CS.release_for_dataset(c, {"epsilon": 0.1, "max_log2": 6}, 0, dataset="d", source="t")
    assert set(rec) >= {"mechanism", "epsilon", "noise_scale", "dp_event", "noisy_counts", "bin_lower_edges", "seed"}
    assert not any(k in rec for k in ("counts", "true_counts", "histogram", "n_users", "median"))
    assert rec["noisy_counts"] != CS.histogram(c, 6).tolist() and rec["noise_scale"] == pytest.approx(10)
    again = CS.release_for_dataset(c, {"epsilon": 0.1, "max_log2": 6}, 0, dataset="d", source="t")
    other = CS.release_for_dataset(c, {"epsilon": 0.1, "max_log2": 6}, 0, dataset="e", source="t")
    assert again["noisy_counts"] == rec["noisy_counts"] and other["noisy_counts"] != rec["noisy_counts"]


# ---------------------------------------------------------------- rules on the histogram


@pytest.fixture(scope="module")
def pow2_counts():
    rng = np.random.default_rng(5)
    return 2 ** rng.choice(7, size=2001, p=[0.2, 0.25, 0.2, 0.15, 0.1, 0.06, 0.04])  # odd N: one median


class _UncostedHistogram(CS.NoisyHistogram):
    """The same histogram with its release's cost left out, to compare the rules alone with the exact ones.

    (At eps_stats = 1e4 the Laplace release's PLD alone would need gigabytes, and the SNR rule composes
    `dp_events` into every candidate's sigma.)
    """

    dp_events = ()


@pytest.mark.integration
def test_rules_with_large_eps_stats_recover_the_exact_rules(pow2_counts):
    h = noisy(pow2_counts, eps=1e4)
    hist = _UncostedHistogram(h.lower_edges, h.weights, h.epsilon, h.file)
    assert hist.median_group_size() == ExactCounts(pow2_counts).median_group_size()
    assert hist.mean_bounded(8) == pytest.approx(np.minimum(pow2_counts, 8).mean(), rel=1e-12)
    K, T, eps, delta = 20000, 20, 1.0, 1e-6
    exact = snr_group_size(ExactCounts(pow2_counts), len(pow2_counts), K, T, eps, delta, noise_ratio=4.0)
    private = snr_group_size(hist, len(pow2_counts), K, T, eps, delta, noise_ratio=4.0)
    assert [r["group_size"] for r in private.table] == [r["group_size"] for r in exact.table]
    assert all(r["snr"] is not None for r in exact.table)
    for a, b in zip(private.table, exact.table):
        assert a["snr"] == pytest.approx(b["snr"], rel=1e-6)
    assert private.group_size == exact.group_size > 1


def test_bins_below_g_are_read_at_their_lower_edge():
    c = np.array([1, 3, 3, 5, 6, 7, 9, 30, 100])
    hist = noisy(c, eps=1e4, max_log2=10)
    edge = 2 ** np.floor(np.log2(c))
    for G in (1, 2, 4, 8, 64):
        assert hist.mean_bounded(G) == pytest.approx(np.minimum(edge, G).mean())
    assert hist.median_group_size() == 4  # the noisy median (6) lies in [4, 8): lower edge


def test_empty_noisy_histogram_falls_back_to_one():
    hist = CS.NoisyHistogram(np.array([1, 2, 4]), np.zeros(3), 0.1)
    assert hist.median_group_size() == 1 and hist.group_size_candidates(0.99) == [1] and hist.mean_bounded(4) == 1


# ---------------------------------------------------------------- accounting and calibration


@pytest.mark.parametrize("method,G", [pytest.param("els", 4, marks=pytest.mark.integration), ("uls", 1)])
def test_composition_is_dp_accountings_and_costs_epsilon(method, G):
    sigma, q, T, delta, d = 1.2, 0.02, 100, 1e-6, 1e-3
    lap = CS.laplace_event(0.3)
    alone = epsilon_of(method, sigma, q, T, delta, G, discretization=d)
    total = epsilon_of(method, sigma, q, T, delta, G, discretization=d, extra_events=[lap])
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=d)
    acc.compose(dp_accounting.ComposedDpEvent([lap, mech(method, q, T, G).dp_event(sigma)]))
    assert total == pytest.approx(acc.get_epsilon(delta), rel=1e-6)
    assert alone < total <= alone + 0.3 + 1e-3
    # The Laplace event alone: 0.3-DP, so its epsilon at delta is at most 0.3.
    assert 0.25 < A.fixed_events_epsilon([lap], delta) <= 0.3 + 1e-3


@pytest.mark.integration
@pytest.mark.parametrize("method,G", [("els", 3), ("uls", 1)])
def test_calibration_targets_the_total(method, G):
    q, T, delta, eps = 0.02, 100, 1e-6, 2.0
    lap = CS.laplace_event(0.3)
    base = calibrate_method(method, eps, delta, q, T, G)
    with_stats = calibrate_method(method, eps, delta, q, T, G, extra_events=[lap])
    assert with_stats.noise_multiplier > base.noise_multiplier * 1.01
    s = with_stats.noise_multiplier
    assert epsilon_of(method, s, q, T, delta, G, extra_events=[lap]) == pytest.approx(with_stats.epsilon_achieved)
    assert with_stats.epsilon_achieved <= eps
    assert epsilon_of(method, s / (1 + 2e-3), q, T, delta, G, extra_events=[lap]) > eps


def test_fixed_events_that_spend_the_target_fail():
    with pytest.raises(PrivacyError, match="already spend"):
        calibrate_method("uls", 0.5, 1e-6, 0.02, 100, extra_events=[CS.laplace_event(1.0)], cell="cell X")


# ---------------------------------------------------------------- plans and ledgers


def ledger_of(plan, steps):
    return build_ledger(plan, RunFacts(steps_completed=steps, expected_batch=plan.expected_batch, n_train_users=1,
                                 n_pool_examples=1, examples_processed=1, users_processed=1,
                                 learning_rate=1e-3, training={}, seeds={"run": 0}))


@pytest.mark.integration
@pytest.mark.parametrize("method", ["els", "uls"])
def test_plan_and_ledger_compose_the_release(counts, method):
    K, T, eps = 6000, 40, 4.0
    hist = noisy(counts)
    plan = plan_cell(dataset="d", method=method, epsilon=eps, compute_budget=K, steps=T, counts=counts,
                     privacy=STATS_ON, stats=hist)
    public = plan_cell(dataset="d", method=method, epsilon=eps, compute_budget=K, steps=T, counts=counts,
                       privacy=PRIVACY, group_size=plan.group_size)
    rec = plan.contribution_stats
    assert rec["private"] and rec["epsilon"] == 0.2 and rec["file"] == "contributions_dp.json"
    assert plan.accountant.endswith("+" + CS.ACCOUNTANT_SUFFIX) and "private" in plan.contribution_statistics
    assert plan.noise_multiplier > public.noise_multiplier  # same G, q: the release costs noise
    assert rec["epsilon_training_only"] < plan.epsilon_achieved <= eps
    # N_G, mbar_G come from the release (only N is read from the counts): no exact sum in the plan, and the
    # sampling rate is the budget's on the release's sizes (docs/privacy.md, "What is treated as public").
    G = plan.group_size
    assert plan.planning_sizes == "DP histogram" and plan.n_train_examples is None
    assert plan.n_train_users == counts.size
    assert plan.mean_bounded_contribution == hist.mean_bounded(G)
    assert plan.n_train_examples_bounded == pytest.approx(counts.size * hist.mean_bounded(G), rel=1e-12)
    if G > 1:  # (with G = 1, N_G = N, the public size)
        assert plan.n_train_examples_bounded != int(np.minimum(counts, G).sum())
    if method == "els":
        assert plan.sampling_rate == pytest.approx(K / T / (counts.size * hist.mean_bounded(G)), rel=1e-12)
    else:
        assert plan.sampling_rate == pytest.approx(K / (T * hist.mean_bounded(G)) / counts.size, rel=1e-12)
    # Invariant 6: epsilon recomputed from the ledger equals the planned one, and meets the target.
    ledger = ledger_of(plan, T)
    assert ledger["epsilon"] == pytest.approx(plan.epsilon_achieved, rel=1e-9)
    assert ledger["contribution_stats"]["epsilon"] == 0.2
    sigma_lo = plan.noise_multiplier / (1 + 2e-3)
    assert epsilon_of(method, sigma_lo, plan.sampling_rate, T, plan.delta, plan.group_size,
                             extra_events=[hist.dp_events[0]]) > eps
    # A run stopped before any step has still spent the release.
    assert ledger_of(plan, 0)["epsilon"] == pytest.approx(A.fixed_events_epsilon([hist.dp_events[0]], plan.delta))
    if method == "els":
        assert plan.group_size == hist.median_group_size() and "DP histogram" in plan.group_size_rule


@pytest.mark.integration
def test_nonprivate_cell_with_stats(counts):
    plan = plan_cell(dataset="d", method="uls", epsilon=math.inf, compute_budget=6000, steps=40, counts=counts,
                     privacy=STATS_ON, stats=noisy(counts), reference_epsilon=4.0)
    assert plan.noise_multiplier == 0 and math.isinf(plan.epsilon_achieved)
    assert math.isinf(ledger_of(plan, 40)["epsilon"])


@pytest.mark.integration
def test_default_off_leaves_the_plan_unchanged(counts):
    off = {**PRIVACY, "contribution_stats": {"private": False, "epsilon": 0.1, "max_log2": 20}}
    for method in ("els", "uls"):
        a = plan_cell(dataset="d", method=method, epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                      privacy=PRIVACY)
        b = plan_cell(dataset="d", method=method, epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                      privacy=off)
        assert json.dumps(a.without_timing(), sort_keys=True) == json.dumps(b.without_timing(), sort_keys=True)
        assert "contribution_stats" not in b.to_record()
        assert b.contribution_statistics == "treated as public (docs/privacy.md)"
        assert "+" not in b.accountant
        led = ledger_of(b, 40)
        assert "contribution_stats" not in led and led["epsilon"] == pytest.approx(b.epsilon_achieved, rel=1e-9)


def test_errors_name_the_cell_and_key(counts):
    big = {**STATS_ON, "contribution_stats": {"private": True, "epsilon": 4.0, "max_log2": 20}}
    with pytest.raises(PrivacyError, match=r"cell dataset=d method=els eps=4 .*privacy\.contribution_stats\.epsilon"):
        plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                  privacy=big, stats=noisy(counts, eps=4.0))
    with pytest.raises(PrivacyError, match="contributions_dp.json"):
        plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                  privacy=STATS_ON)
    with pytest.raises(PrivacyError, match="private is false"):
        plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                  privacy=PRIVACY, stats=noisy(counts))


# ---------------------------------------------------------------- the rule is wired


REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = """\
from snakemake.utils import validate
configfile: "config/config.yaml"
include: "workflow/rules/common.smk"
validate(config, "workflow/schemas/config.schema.yaml")
include: "workflow/rules/plan.smk"
"""


def _workdir(tmp_path: Path, private: bool, long_examples: str) -> Path:
    (tmp_path / "workflow").symlink_to(REPO / "workflow")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(
        "seed: 0\ndatasets:\n  tiny: {source: synthetic}\n"
        f"tokenizer: {{long_examples: {long_examples}}}\n"
        "grid: {datasets: [tiny], methods: [els], epsilons: [4], budgets: [{compute: 600, steps: 20}], nonprivate: false}\n"
        f"privacy:\n  contribution_stats: {{private: {str(private).lower()}, epsilon: 0.5}}\n"
    )
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    d = tmp_path / "results" / "data" / "tiny"
    d.mkdir(parents=True)
    rng = np.random.default_rng(2)
    n = 301
    ex = np.clip(np.round(np.exp(rng.normal(np.log(3), 0.8, n))), 1, 20).astype(int)
    split = np.where(np.arange(n) < 251, "train", "test")
    pd.DataFrame({"user_id": [f"u{i}" for i in range(n)], "split": split, "n_examples": ex}).to_parquet(
        d / "users.parquet", index=False)
    rows = np.repeat(np.arange(n), 2 * ex)  # chunking doubled every user's rows
    pd.DataFrame({"user_id": [f"u{i}" for i in rows], "example_id": np.arange(rows.size), "split": split[rows],
                  "input_ids": [[1, 2]] * rows.size}).to_parquet(d / "tokens.parquet", index=False)
    (d / "contributions.json").write_text(json.dumps({"median_train": float(np.median(ex[:251])),
                                                      "n_users": {"train": 251, "validation": 25, "test": 25}}))
    return tmp_path


def _snakemake(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--nolock", *args],
                          cwd=root, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_snakemake_wires_the_release_and_the_row_counts(tmp_path):
    target = "results/plan/tiny/method~els/eps~4/budget~600.json"
    root = _workdir(tmp_path, private=True, long_examples="chunk")
    p = _snakemake(root, target)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    plan = json.loads((root / target).read_text())
    release = json.loads((root / "results/data/tiny/contributions_dp.json").read_text())
    assert release["epsilon"] == 0.5 and "tokens.parquet" in release["count_source"]
    assert plan["contribution_stats"]["file"].endswith("contributions_dp.json")
    # The exact row total is a statistic of the counts: not in the plan (N_G, mbar_G come from the release).
    assert plan["n_train_examples"] is None and plan["planning_sizes"] == "DP histogram"
    assert plan["n_train_users"] == 251
    assert "tokens.parquet" in plan["contribution_counts"] and plan["median_train"] is None
    assert plan["epsilon_achieved"] <= 4


@pytest.mark.integration
def test_snakemake_default_off_does_not_wire_the_release(tmp_path):
    root = _workdir(tmp_path, private=False, long_examples="truncate")
    p = _snakemake(root, "-n", "--forceall", "results/plan/tiny/method~els/eps~4/budget~600.json")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "rule plan:" in p.stdout and "results/data/tiny/users.parquet" in p.stdout
    assert "contribution_stats_dp" not in p.stdout
    assert "contributions_dp.json" not in p.stdout and "tokens.parquet" not in p.stdout


def test_secret_seeds_release_is_fresh_and_hides_its_seed():
    """privacy.secret_seeds: the histogram noise is not derivable from the config."""
    from userdp.privacy.contribution_stats import release_for_dataset

    counts = np.arange(1, 200)
    public_a = release_for_dataset(counts, {"epsilon": 0.5}, 0, dataset="d", source="users")
    public_b = release_for_dataset(counts, {"epsilon": 0.5}, 0, dataset="d", source="users")
    assert public_a["noisy_counts"] == public_b["noisy_counts"]  # reproducible by default
    s1 = release_for_dataset(counts, {"epsilon": 0.5}, 0, dataset="d", source="users", secret=True)
    s2 = release_for_dataset(counts, {"epsilon": 0.5}, 0, dataset="d", source="users", secret=True)
    assert s1["noisy_counts"] != s2["noisy_counts"] and s1["seed"] == "secret"
