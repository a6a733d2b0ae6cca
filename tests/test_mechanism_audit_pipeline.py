"""The white-box mechanism audit through the pipeline: `snakemake audit_mechanism` and `python -m userdp
audit-mechanism` (output, --json forms, bad arguments), on a small audit of the embedded synthetic dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from userdp.evaluation import mechanism_audit as ma

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
SMALL = {"canaries": 100, "steps": 2, "other_users": 10, "physical_batch_size": 64}
CONFIG = {
    "datasets": {"tiny": {"source": "synthetic"}},
    "grid": {"datasets": ["tiny"]},
    "training": {"threads": 1, "device": "cpu"},
    "audit": {"methods": ["els", "uls"], "epsilons": [2], "mechanism": SMALL},
}
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _config(tmp_path: Path, **audit) -> Path:
    cfg = {**CONFIG, "audit": {**CONFIG["audit"], **audit}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "userdp", "audit-mechanism", *args], capture_output=True, text=True,
                          timeout=600, env=ENV)


def test_snakemake_audit_mechanism_writes_the_table(tmp_path):
    cfg = _config(tmp_path)
    cmd = [sys.executable, "-m", "snakemake", "audit_mechanism", "-s", str(REPO / "Snakefile"), "--directory",
           str(tmp_path / "work"), "--configfile", str(cfg), "--cores", "1", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    df = pd.read_csv(tmp_path / "work" / "results/audit/tiny/mechanism.csv")
    for col in ("method", "epsilon_claimed", "epsilon_lower_bound", "epsilon_lower_bound_ceiling", "canaries"):
        assert col in df.columns
    assert sorted(df["method"]) == ["els", "uls"] and (df["epsilon_target"] == 2).all()
    assert (df["canaries"] == 100).all() and (df["dataset"] == "tiny").all()
    assert (df["epsilon_claimed"] <= 2).all() and (df["epsilon_claimed"] > 1.99).all()
    assert (df["epsilon_lower_bound"] <= df["epsilon_claimed"]).all()
    # q = 1: each canary's release is Gaussian, both estimators report, the confidence split over them
    assert (df["sampling_rate"] == 1.0).all()
    for col, value in ma.ceilings(100, 1e-6, 0.95, (0.05, 0.1, 0.2, 0.5), gaussian=True).items():
        assert (df[col] == value).all(), col
    assert (df["epsilon_lower_bound_fdp"] <= df["epsilon_claimed"]).all() and not df["bound_exceeds_claim"].any()
    assert not df["noise_check_failed"].any()
    # the target also draws the figure of empirical vs claimed epsilon from the table
    for fmt in ("png", "pdf"):
        assert (tmp_path / "work" / f"results/figures/audit_mechanism_epsilon_tiny.{fmt}").stat().st_size > 1000
    # a second run has nothing to do
    again = subprocess.run(cmd[:-1] + ["-n"], capture_output=True, text=True, timeout=300, env=ENV)
    assert again.returncode == 0 and "audit_mechanism_table" not in again.stdout + again.stderr


def test_cli_json_one_cell_and_several(tmp_path):
    cfg = _config(tmp_path)
    one = _cli("--configfile", str(cfg), "--method", "uls", "--epsilon", "2", "--json")
    assert one.returncode == 0, one.stderr[-2000:]
    row = json.loads(one.stdout)
    assert row["method"] == "uls" and row["epsilon_target"] == 2 and row["canaries"] == 100
    assert set(ma.COLUMNS) <= set(row)
    several = _cli("--configfile", str(cfg), "--json")
    assert several.returncode == 0, several.stderr[-2000:]
    cells = json.loads(several.stdout)["cells"]
    assert [c["method"] for c in cells] == ["els", "uls"]
    assert cells[1]["epsilon_lower_bound"] == row["epsilon_lower_bound"]  # the same seeds, the same cell
    text = _cli("--configfile", str(cfg), "--method", "els")
    assert text.returncode == 0 and text.stdout.startswith("els eps 2: claimed")


def test_cli_two_processes_give_the_one_process_row(tmp_path):
    one = json.loads(_cli("--configfile", str(_config(tmp_path)), "--method", "uls", "--epsilon", "2",
                          "--json").stdout)
    two_cfg = _config(tmp_path, mechanism={**SMALL, "processes": 2})
    two = _cli("--configfile", str(two_cfg), "--method", "uls", "--epsilon", "2", "--json")
    assert two.returncode == 0, two.stderr[-3000:]
    row = json.loads(two.stdout)
    assert row["processes"] == 2
    for k in ("epsilon_claimed", "noise_multiplier", "epsilon_lower_bound", "best_correct"):
        assert row[k] == pytest.approx(one[k], rel=1e-9), k


@pytest.mark.parametrize("args,message", [
    (["--method", "dp"], "argument --method: invalid choice: 'dp'"),
    (["--epsilon", "3"], "epsilon 3 is not audited"),
    (["--epsilon", "-1"], "epsilon must be a number > 0"),
])
def test_cli_bad_arguments_exit_2_with_the_reason(tmp_path, args, message):
    proc = _cli("--configfile", str(_config(tmp_path, methods=["uls"])), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_cli_not_audited_method_and_bad_config_key(tmp_path):
    proc = _cli("--configfile", str(_config(tmp_path, methods=["uls"])), "--method", "els")
    assert proc.returncode == 2 and "method 'els' is not audited: audit.methods is ['uls']" in proc.stderr
    bad = _config(tmp_path, mechanism={"canaries": 1})
    proc = _cli("--configfile", str(bad))
    assert proc.returncode == 2 and "audit.mechanism.canaries" in proc.stderr, proc.stderr


def test_api_gives_the_cli_row_from_a_file_or_a_mapping(tmp_path):
    import userdp
    from userdp.config import load_config_files

    cfg = _config(tmp_path)
    cli = _cli("--configfile", str(cfg), "--method", "uls", "--epsilon", "2", "--json")
    assert cli.returncode == 0, cli.stderr[-2000:]
    row = json.loads(cli.stdout)
    (from_file,) = userdp.audit_mechanism(cfg, method="uls", epsilon=2)
    (from_mapping,) = userdp.audit_mechanism(load_config_files([cfg]), method="uls", epsilon=2.0)
    for k in ("epsilon_claimed", "noise_multiplier", "epsilon_lower_bound", "epsilon_lower_bound_fdp",
              "best_correct", "noise_std_ratio"):
        assert from_file[k] == pytest.approx(row[k], rel=1e-9), k
        assert from_mapping[k] == pytest.approx(row[k], rel=1e-9), k
    assert set(ma.COLUMNS) <= set(from_file)
    with pytest.raises(userdp.ConfigError, match="epsilon 3 is not audited"):
        userdp.audit_mechanism(cfg, epsilon=3)
