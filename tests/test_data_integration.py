"""The data stage run by the real `snakemake` on a tiny config in a temporary folder.

Uses the repository's Snakefile when every file it includes exists; while
other stages are still missing, a Snakefile with only common.smk and
data.smk (same rules, same scripts) stands in, and the checks that need the
whole workflow are skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]

TINY = """\
seed: 0
datasets:
  synth:
    source: synthetic
    split: {validation: 0.2, test: 0.2}
    synthetic: {n_users: 300, contributions_median: 4, public_examples: 400}
tokenizer: {vocab_size: 300, sequence_length: 16, public_dataset: synth, batch_rows: 500}
model: {n_layer: 1, n_embd: 16, n_head: 2, pretrain: {steps: 2, batch_size: 4}}
grid:
  datasets: [synth]
  methods: [els]
  epsilons: [1]
  budgets: [{compute: 100, steps: 2}]
  nonprivate: false
"""

DATA_ONLY = """\
from snakemake.utils import min_version, validate
configfile: "config/config.yaml"
include: "workflow/rules/common.smk"
validate(config, "workflow/schemas/config.schema.yaml")
include: "workflow/rules/data.smk"
"""


def full_snakefile_ready() -> bool:
    text = (REPO / "Snakefile").read_text()
    return all((REPO / inc).exists() for inc in re.findall(r'include:\s*"([^"]+)"', text))


def make_workdir(tmp: Path, full: bool) -> Path:
    os.symlink(REPO / "workflow", tmp / "workflow")
    (tmp / "config").mkdir()
    (tmp / "config" / "config.yaml").write_text(TINY)
    if full:
        shutil.copy(REPO / "Snakefile", tmp / "Snakefile")
    else:
        (tmp / "Snakefile").write_text(DATA_ONLY)
    return tmp


def smk(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=workdir, capture_output=True, text=True, env=env, timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def job_counts(output: str) -> dict[str, int]:
    """Rule -> job count from the 'Job stats' table of a (dry) run."""
    counts = {}
    for line in output.splitlines():
        m = re.match(r"^([A-Za-z_]\w*)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("wf"), full_snakefile_ready())


def test_data_stage_end_to_end(workdir):
    targets = [
        "results/data/synth/tokens.parquet",
        "results/data/synth/public_tokens.parquet",
        "results/figures/contributions_synth.png",
    ]
    smk(workdir, *targets)
    d = workdir / "results" / "data" / "synth"
    ex = pq.read_table(d / "examples.parquet")
    users = pq.read_table(d / "users.parquet")
    toks = pq.read_table(d / "tokens.parquet")
    stats = json.loads((d / "contributions.json").read_text())
    assert ex.schema.names == ["user_id", "example_id", "split", "text"]
    assert users.schema.names == ["user_id", "split", "n_examples"]
    assert {"user_id", "example_id", "split", "input_ids", "n_tokens"} <= set(toks.schema.names)
    assert toks.num_rows == ex.num_rows and max(toks.column("n_tokens").to_pylist()) <= 16
    assert stats["n_users"]["train"] + stats["n_users"]["validation"] + stats["n_users"]["test"] == 300
    assert sum(stats["n_examples"].values()) == ex.num_rows
    assert stats["treated_as_public"] is True and "0.99" in stats["quantiles_train"]
    assert (d / "public.parquet").exists() and pq.read_table(d / "public_tokens.parquet").num_rows == 400
    info = json.loads((workdir / "results" / "tokenizer" / "tokenizer_info.json").read_text())
    assert info["trained_on"] == "results/data/synth/public.parquet"
    assert (workdir / "results" / "figures" / "contributions_synth.pdf").exists()
    for log in ("prepare_synth.log", "tokenize_synth.log", "tokenizer.log"):
        assert (workdir / "results" / "logs" / "data" / log).stat().st_size > 0
    # A second run has nothing to do.
    again = smk(workdir, "-n", *targets)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_new_dataset_from_configfile_builds_only_itself(workdir, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("datasets:\n  other:\n    source: synthetic\n    synthetic: {n_users: 50}\n")
    out = smk(workdir, "-n", "-F", "results/data/other/contributions.json", "--configfile", str(extra))
    assert job_counts(out.stdout + out.stderr) == {"download_data": 1, "prepare_data": 1}


def test_bad_dataset_key_is_a_clear_error(workdir, tmp_path):
    extra = tmp_path / "bad.yaml"
    extra.write_text("datasets:\n  synth:\n    source: synthetic\n    synthetic: {n_user: 50}\n")
    out = smk(workdir, "-n", "results/data/synth/contributions.json", "--configfile", str(extra), check=False)
    assert out.returncode != 0
    assert "n_user" in out.stdout + out.stderr


def test_lint_of_data_rules(tmp_path):
    wd = make_workdir(tmp_path, full=False)
    out = smk(wd, "--lint")
    assert "Congratulations" in out.stdout + out.stderr, out.stdout + out.stderr


def test_default_target_dry_run_and_lint(tmp_path):
    if not full_snakefile_ready():
        pytest.skip("Snakefile includes rule files that do not exist yet")
    wd = make_workdir(tmp_path, full=True)
    out = smk(wd, "-n")
    counts = job_counts(out.stdout + out.stderr)
    assert counts.get("prepare_data") == 1 and counts.get("tokenize") == 1
    lint = smk(wd, "--lint", check=False)
    assert "data.smk" not in lint.stdout + lint.stderr, lint.stdout
