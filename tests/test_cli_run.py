"""`python -m userdp run`: snakemake's arguments with targets before the options that would swallow them,
config files checked first (userdp.snakemake_args, userdp.cli)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from userdp import snakemake_args
from userdp.cli import main
from userdp.snakemake_args import is_config_file, order_args, snakemake_options

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "configs" / "tiny.yaml"
TARGET = "results/data/tiny/contributions.json"


@pytest.fixture(scope="module")
def options():
    return snakemake_options()


@pytest.mark.parametrize("args, expected", [
    # a target after --configfile's files goes before; the files (YAML or JSON) stay
    (["-n", "--configfile", "a.yaml", "b.yaml", "target"], ["target", "-n", "--configfile", "a.yaml", "b.yaml"]),
    (["--configfiles", "a.yml", "b.json", "audit", "--cores", "2"],
     ["audit", "--configfiles", "a.yml", "b.json", "--cores", "2"]),
    # a .json file in the workflow's output folders is a target, not a config file
    (["--configfile", "mine.yaml", "results/data/mine/contributions.json"],
     ["results/data/mine/contributions.json", "--configfile", "mine.yaml"]),
    (["--configfile", "mine.yaml", "./data/mine/download.json"],
     ["./data/mine/download.json", "--configfile", "mine.yaml"]),
    # --configfile's first value is its file whatever its name; an abbreviation and =value are read as argparse does
    (["--configfile", "myconf", "audit"], ["audit", "--configfile", "myconf"]),
    (["--configf", "a.yaml", "audit"], ["audit", "--configf", "a.yaml"]),
    (["--configfile=a.yaml", "audit"], ["audit", "--configfile=a.yaml"]),
    # --config (and -C) keeps KEY=VALUE entries; so do the other NAME=VALUE options
    (["--config", "seed=1", "audit", "-n"], ["audit", "--config", "seed=1", "-n"]),
    (["-C", "seed=1", "x", "-Cseed=2", "y"], ["x", "y", "-C", "seed=1", "-Cseed=2"]),
    (["--resources", "mem_mb=100", "audit"], ["audit", "--resources", "mem_mb=100"]),
    (["--set-threads", "finetune=4", "audit"], ["audit", "--set-threads", "finetune=4"]),
    # options with choices keep theirs (also one-letter flags run together), take no target
    (["-nq", "rules", "audit"], ["audit", "-nq", "rules"]),
    (["--quiet", "audit"], ["audit", "--quiet"]),
    (["--dag", "audit"], ["audit", "--dag"]),
    (["--dag", "dot", "audit"], ["audit", "--dag", "dot"]),
    # one-value options take theirs, whatever it is; targets already in front stay
    (["audit", "--cores", "2", "-j2", "--configfile", "a.yaml"], ["audit", "--cores", "2", "-j2", "--configfile",
                                                                  "a.yaml"]),
    # values that cannot be told from targets stay (rule names of --forcerun)
    (["--forcerun", "finetune", "audit"], ["--forcerun", "finetune", "audit"]),
    # targets after `--` join the others (argparse reads one run of them)
    (["--configfile", "a.yaml", "audit", "--", "evaluation"], ["audit", "evaluation", "--configfile", "a.yaml"]),
    ([], []),
])
def test_targets_go_before_the_options(options, args, expected):
    assert order_args(args, options).argv == expected


def test_what_the_reordering_reports(options):
    call = order_args(["-n", "--replace-workflow", "--configfile", "a.yaml", "b.yaml", "t1", "--config", "seed=1",
                       "t2", "t3", "--cores", "1"], options)
    assert call.argv == ["t1", "t2", "t3", "-n", "--replace-workflow", "--configfile", "a.yaml", "b.yaml",
                         "--config", "seed=1", "--cores", "1"]
    assert call.targets == call.moved == ["t1", "t2", "t3"]  # all three stood among --configfile/--config values
    assert call.configfiles == ["a.yaml", "b.yaml"] and call.config == ["seed=1"]
    assert {"dryrun", "replace_workflow_config", "configfile", "config", "cores"} == call.given


def test_config_files_and_targets():
    assert is_config_file("my.yaml") and is_config_file("conf/x.YML") and is_config_file("/abs/x.json")
    assert is_config_file("results.json")  # a file, not the results/ folder
    assert not is_config_file("results/findings/default.json") and not is_config_file("data/so/download.json")
    assert not is_config_file("audit") and not is_config_file("results/report.html")


def test_the_option_table_is_snakemakes(options):
    """Read from the installed snakemake's parser: what the reordering relies on is there."""
    assert options["--configfile"] is options["--configfiles"] and options["--configfile"].nargs == "+"
    assert options["--config"] is options["-C"] and options["--config"].key_value
    assert options["-n"].nargs == 0 and options["--cores"].nargs in ("?", 1)
    assert "rules" in options["--quiet"].choices


def test_a_missing_config_file_stops_before_snakemake(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(snakemake_args, "run_snakemake", lambda argv: pytest.fail(f"snakemake started: {argv}"))
    missing = tmp_path / "nope.yaml"
    assert main(["run", "-n", "--configfile", str(missing), "audit"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("userdp run: error:") and f"config file {missing} does not exist" in err
    assert "Traceback" not in err


def test_config_mistakes_are_named_and_stop_before_snakemake(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(snakemake_args, "run_snakemake", lambda argv: pytest.fail(f"snakemake started: {argv}"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid:\n  seeds: [0\n")
    assert main(["run", "--configfile", str(bad), TARGET]) == 2
    assert f"config file {bad} is not valid YAML at line 3" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("grid:\n  seeds: [0, 1]\n")
    # alone (--replace-workflow-config) it lacks the datasets
    assert main(["run", "--replace-workflow-config", "--configfile", str(good), TARGET]) == 2
    assert "datasets" in capsys.readouterr().err
    # --config entries are merged last, as snakemake does
    assert main(["run", "--configfile", str(good), "--config", "seed=-1", TARGET]) == 2
    assert "'seed'" in capsys.readouterr().err


def test_snakemake_gets_the_reordered_arguments_and_its_status_is_returned(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(snakemake_args, "run_snakemake", lambda argv: calls.append(argv) or 3)
    good = tmp_path / "good.yaml"
    good.write_text("grid:\n  seeds: [0, 1]\n")
    assert main(["run", "-n", "--configfile", str(good), TARGET]) == 3
    assert calls == [[TARGET, "-n", "--configfile", str(good)]]
    assert f"targets ['{TARGET}'] moved before" in capsys.readouterr().err
    # snakemake's own help needs no config check
    assert main(["run", "--help", "--configfile", str(tmp_path / "nope.yaml")]) == 3


def test_run_help_is_ours(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--help"])
    assert exc.value.code == 0
    assert "targets written after --configfile" in " ".join(capsys.readouterr().out.split())


@pytest.mark.integration
def test_dry_run_succeeds_where_the_plain_order_fails(tmp_path):
    """The order a new user writes: snakemake reads the target as a config file; `userdp run` runs it."""
    args = ["-n", "-s", str(REPO / "Snakefile"), "--replace-workflow-config", "--configfile", str(TINY), TARGET]
    plain = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode != 0 and "FileNotFoundError" in plain.stderr + plain.stdout
    ours = subprocess.run([sys.executable, "-m", "userdp", "run", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    out = ours.stdout + ours.stderr
    assert ours.returncode == 0, out[-3000:]
    assert "prepare_data" in out and "This was a dry-run" in out
    assert not (tmp_path / "results").exists()  # a dry run, in the working directory it was started in


@pytest.mark.integration
def test_snakemake_is_started_with_this_python_and_its_status_returned(capfd):
    import snakemake

    assert snakemake_args.run_snakemake(["--version"]) == 0
    assert capfd.readouterr().out.strip() == snakemake.__version__
