"""The mean-estimation rules in a real snakemake run (real calibration) on a tiny config."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from userdp.plotting.registry import figure_targets

REPO = Path(__file__).resolve().parents[1]
RULES = ["mean_estimation_calibration", "mean_estimation", "plot_mean_estimation_vs_epsilon",
         "plot_mean_estimation_vs_diversity", "plot_mean_estimation_vs_budget", "plot_mean_estimation_vs_group_size"]
FIGURES = ["vs_epsilon", "vs_diversity", "vs_budget", "vs_group_size"]

CONFIG = {
    "datasets": {"toy": {"source": "synthetic"}},
    "mean_estimation": {
        # Large sampling rates and few steps keep the real accountant fast.
        "dimension": 4, "n_users": 100, "contributions_median": 3, "contributions_sigma": 0.7,
        # One epsilon and one budget: each real calibration takes seconds.
        "diversities": [0.1, 3.0], "epsilons": [4], "budgets": [{"compute": 150, "steps": 5}],
        "group_sizes": [1, 2], "learning_rates": [0.3, 1.0], "seeds": [0, 1], "tuning_seeds": [0],
    },
}


def snakemake(root: Path, *targets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(root),
           "--configfile", str(root / "extra.yaml"), "--cores", "1", "--allowed-rules", *RULES, "--", *targets]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.integration
def test_mean_estimation_rules_run_end_to_end(tmp_path):
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump(CONFIG))
    targets = ["results/mean_estimation/results.parquet"] + figure_targets(CONFIG, family="mean_estimation")
    assert len(targets) == 1 + 2 * len(FIGURES)
    res = snakemake(tmp_path, *targets)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    for t in targets:
        assert (tmp_path / t).stat().st_size > 0, t
    df = pd.read_parquet(tmp_path / "results/mean_estimation/results.parquet")
    cal = pd.read_parquet(tmp_path / "results/mean_estimation/calibration.parquet")
    # Real calibration: achieved epsilon within the target, noise > 0.
    assert (cal.epsilon_achieved <= cal.epsilon * (1 + 1e-9)).all() and (cal.noise_multiplier > 0).all()
    # ELS median G is 3 here: not in the sweep [1, 2], so ELS adds it.
    assert set(df[df.method == "els"].group_size) == {1, 2, 3}
    assert set(df[df.method == "uls"].group_size) == {1, 2}
    assert len(df) == 8 + 12  # ULS: 2 s x 2 G x 2 seeds; ELS: 2 s x 3 G x 2 seeds
    assert len(cal) == 5
    assert "ULS (best G) / ELS" in (tmp_path / "results/logs/mean_estimation/run.log").read_text()

    # Plotting is separate from computing: a second run has nothing to do.
    again = snakemake(tmp_path, *targets)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
