"""The lane guard (tests/conftest.py): a test not marked integration cannot start the pipeline.

These tests run in the fast lane and use the guard the whole session runs under: each refused command
is refused before any process starts, so the test fails with what to mark (tests/README.md, 'Test lanes').
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.multiprocessing as mp  # loaded before the tests run (the guard patches a loaded torch)

REFUSED = pytest.fail.Exception  # what the guard raises: a test failure, which `except Exception` cannot swallow

PIPELINE_COMMANDS = [
    pytest.param([sys.executable, "-m", "snakemake", "--version"], "python -m snakemake", id="snakemake"),
    pytest.param(["snakemake", "-n"], "starts snakemake", id="snakemake-program"),
    pytest.param("snakemake --cores 2 all", "starts snakemake", id="shell-string"),
    pytest.param([sys.executable, "-m", "userdp", "epsilon", "--help"], "python -m userdp", id="userdp-cli"),
    pytest.param(["/venv/bin/userdp", "run", "-n"], "starts userdp", id="userdp-program"),
    pytest.param([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "x"],
                 "python -m torch.distributed.run", id="torch-distributed-run"),
    pytest.param(["torchrun", "--nproc_per_node", "2", "job.py"], "starts torchrun", id="torchrun"),
    pytest.param([sys.executable, "-m", "userdp.training.finetune_job", "--job", "j.json"],
                 "python -m userdp.training.finetune_job", id="finetune-job"),
    pytest.param([sys.executable, "workflow/scripts/plan.py"], "the workflow script plan.py", id="workflow-script"),
]


@pytest.mark.parametrize("command,named", PIPELINE_COMMANDS)
def test_a_fast_test_that_starts_the_pipeline_fails(command, named):
    with pytest.raises(REFUSED, match="mark this test integration") as exc:
        subprocess.run(command, capture_output=True)
    assert named in str(exc.value) and "tests/README.md" in str(exc.value)


def test_the_library_s_own_process_starts_are_refused_too():
    """`userdp run` starts snakemake through userdp.snakemake_args; torchrun through training.distributed."""
    from userdp.snakemake_args import run_snakemake

    with pytest.raises(REFUSED, match="python -m snakemake; mark this test integration"):
        run_snakemake(["--version"])


def test_a_fast_test_that_starts_any_process_unmarked_fails():
    with pytest.raises(REFUSED, match="helper_process"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(REFUSED, match="helper_process"):
        subprocess.check_output(["git", "--version"])


def test_multi_process_training_is_refused():
    with pytest.raises(REFUSED, match="multi-process training; mark this test integration"):
        mp.spawn(print, nprocs=2)
    with pytest.raises(REFUSED, match="multi-process training"):
        mp.start_processes(print, nprocs=2, start_method="spawn")


def test_the_slurm_plugin_s_probes_may_run():
    """`which` (and `scontrol show config` where SLURM is installed): snakemake's SLURM plugin runs them when
    snakemake's parser is built in the test process (`userdp run` reads snakemake's options)."""
    subprocess.run(["which", "sacct"], capture_output=True)
    with pytest.raises(REFUSED, match="helper_process"):
        subprocess.run(["whichever", "sacct"], capture_output=True)


@pytest.mark.helper_process
def test_a_helper_process_may_run_but_not_a_pipeline():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout == "42\n"
    with pytest.raises(REFUSED, match="starts python -m snakemake; mark this test integration"):
        subprocess.run([sys.executable, "-m", "snakemake", "--version"])


@pytest.mark.integration
def test_an_integration_test_may_start_anything():
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1:])", "-m", "snakemake"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "['-m', 'snakemake']"
