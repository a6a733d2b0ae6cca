"""config/study.yaml: its grid can show the study's effects, it dry-runs, and a tiny version runs end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from userdp.config import validate_config
from userdp.evaluation import findings as F

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "config" / "study.yaml"
TINY = REPO / "tests" / "configs" / "tiny_study.yaml"


def merged_study() -> dict:
    """config/config.yaml with config/study.yaml on top, as `snakemake --configfile config/study.yaml` merges them."""
    from snakemake.utils import update_config

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(base, yaml.safe_load(STUDY.read_text()))
    return validate_config(base)


def test_study_grid_meets_its_design():
    c = merged_study()
    g = c["grid"]
    computes = [b["compute"] for b in g["budgets"]]
    assert len(computes) >= 3 and max(computes) / min(computes) >= 16
    assert len([e for e in g["epsilons"] if math.isfinite(float(e))]) >= 2 and g["nonprivate"]
    assert len(g["seeds"]) >= 3 and len(g["group_size_sweep"]) >= 2
    assert len(c["training"]["learning_rates"]) >= 2  # chosen on validation users; the released epsilon covers it
    specs = [c["datasets"][d] for d in g["datasets"]]
    assert all(s["source"] == "synthetic" for s in specs)
    alphas = sorted(s["synthetic"]["alpha"] for s in specs)
    assert alphas[0] < alphas[-1]
    # the corpora differ only in alpha
    rest = [{k: v for k, v in s["synthetic"].items() if k != "alpha"} for s in specs]
    assert all(r == rest[0] for r in rest)
    assert c["findings"]["name"] == "study"


def dry_run(workdir: Path, configfile: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory",
                           str(workdir), "--configfile", str(configfile), "--cores", "2", *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def job_counts(out: str) -> dict[str, int]:
    lines = out.split("Job stats:")[1].splitlines()[3:]
    counts = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    return counts


@pytest.mark.integration
def test_study_config_dry_runs(tmp_path):
    jobs = job_counts(dry_run(tmp_path, STUDY))
    c = merged_study()
    g = c["grid"]
    n_lr = len(c["training"]["learning_rates"])
    main = len(g["datasets"]) * len(g["methods"]) * (len(g["epsilons"]) + 1) * len(g["budgets"]) * len(g["seeds"])
    sweep = len(g["datasets"]) * len(g["methods"]) * len(g["group_size_sweep"]) * len(g["seeds"])
    assert n_lr > 1  # the sweep is chosen on validation users
    # one finetune job per cell trains and evaluates every learning rate
    assert jobs["finetune"] + jobs["finetune_group"] == main + sweep == jobs["select_lr"] and "evaluate" not in jobs
    assert jobs["findings"] == 1 and jobs["plot_lm_uls_minus_els"] == len(g["datasets"])


@pytest.mark.integration
def test_tiny_study_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
                           str(tmp_path), "--configfile", str(TINY), "--replace-workflow-config", "--cores", "2",
                           "results/findings/tiny_study.json", "results/figures/lm_uls_minus_els_diverse.png",
                           "results/figures/lm_loss_vs_budget_homog.png"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads((tmp_path / "results/findings/tiny_study.json").read_text())
    rows = {(f["claim_id"], f["domain"], f["claim"]): f for f in result["findings"]}
    lm = {k[0]: f for k, f in rows.items() if k[1] == F.LM}
    # the compute and diversity axes exist: claims 2 and 3 are measured (with intervals over the two seeds)
    for claim in (1, 2, 3, 4):
        assert lm[claim]["verdict"] in (F.REPRODUCED, F.NOT_REPRODUCED, F.INCONCLUSIVE), lm[claim]
        assert lm[claim]["ci_low"] is not None and lm[claim]["ci_low"] <= lm[claim]["effect"] <= lm[claim]["ci_high"]
    assert "diverse" in lm[3]["measured_at"] and "homog" in lm[3]["measured_at"]
    assert any(k[0] == 5 for k in rows) and any(k[1] == F.ME for k in rows)
    assert sum(result["counts"].values()) == len(result["findings"])
    assert (tmp_path / "results/findings/tiny_study.csv").exists()
