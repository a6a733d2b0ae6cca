"""`python -m userdp epsilon|calibrate`: JSON fields, values, argument errors."""

import json
import subprocess
import sys

import pytest

from userdp.cli import main
from privacy_helpers import epsilon_of


EPSILON_ARGS = ["epsilon", "--method", "els", "--noise-multiplier", "2", "--sampling-rate", "0.01", "--steps", "100",
                "--group-size", "4", "--delta", "1e-6", "--json"]
INFEASIBLE_ARGS = ["calibrate", "--method", "els", "--epsilon", "0.01", "--delta", "1e-6", "--sampling-rate", "1",
                   "--steps", "10", "--group-size", "4", "--max-noise-multiplier", "5"]


def run(*args):
    return subprocess.run([sys.executable, "-m", "userdp", *args], capture_output=True, text=True, timeout=300)


def test_epsilon_json_matches_library(capsys):
    assert main(list(EPSILON_ARGS)) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["method"] == "els" and rec["group_size"] == 4 and rec["steps"] == 100
    assert rec["epsilon"] == pytest.approx(epsilon_of("els", 2.0, 0.01, 100, 1e-6, 4), rel=1e-12)


@pytest.mark.integration
def test_python_m_userdp_prints_the_json_and_exits_2_on_an_infeasible_target():
    """The same two commands through `python -m userdp` (the installed entry): stdout, exit statuses."""
    p = run(*EPSILON_ARGS)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["epsilon"] == pytest.approx(epsilon_of("els", 2.0, 0.01, 100, 1e-6, 4), rel=1e-12)
    p = run(*INFEASIBLE_ARGS)
    assert p.returncode == 2
    assert "no noise multiplier up to" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.integration
def test_calibrate_json_has_plan_fields(capsys):
    assert main(["calibrate", "--method", "uls", "--epsilon", "2", "--delta", "1e-6", "--sampling-rate", "0.02",
                 "--steps", "50", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    for key in ("method", "epsilon", "delta", "group_size", "sampling_rate", "steps", "noise_multiplier",
                "epsilon_achieved", "accountant"):
        assert key in rec
    assert rec["epsilon_achieved"] <= 2.0
    assert epsilon_of("uls", rec["noise_multiplier"], 0.02, 50, 1e-6) <= 2.0


def test_calibrate_inf_prints_inf(capsys):
    assert main(["calibrate", "--method", "els", "--epsilon", "inf", "--delta", "1e-6", "--sampling-rate", "0.02",
                 "--steps", "50", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["noise_multiplier"] == 0 and rec["epsilon_achieved"] == "inf"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["calibrate", "--epsilon", "0"], "epsilon must be a number > 0"),
        (["calibrate", "--epsilon", "-1"], "epsilon must be a number > 0"),
        (["calibrate", "--epsilon", "1", "--sampling-rate", "1.5"], "sampling rate must be in (0, 1]"),
        (["calibrate", "--epsilon", "1", "--sampling-rate", "0"], "sampling rate must be in (0, 1]"),
        (["calibrate", "--epsilon", "1", "--group-size", "0"], "group size must be a whole number >= 1"),
        (["calibrate", "--epsilon", "1", "--delta", "1"], "delta must be in (0, 1)"),
        (["epsilon", "--noise-multiplier", "-2"], "noise multiplier must be"),
    ],
)
def test_invalid_arguments_exit_2_with_message(args, needle, capsys):
    base = {"--method": "els", "--sampling-rate": "0.01", "--steps": "10", "--delta": "1e-6"}
    full = list(args)
    for k, v in base.items():
        if k not in full:
            full += [k, v]
    with pytest.raises(SystemExit) as exc:
        main(full)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_infeasible_target_exits_2_with_reason(capsys):
    assert main(list(INFEASIBLE_ARGS)) == 2
    err = capsys.readouterr().err
    assert "no noise multiplier up to" in err and "Traceback" not in err


@pytest.mark.integration
def test_stats_epsilon_composes_the_contribution_statistics_release(capsys):
    """--stats-epsilon adds the Laplace histogram release, as plans with DP statistics do."""
    import dp_accounting

    base = ["--method", "uls", "--sampling-rate", "0.02", "--steps", "50", "--delta", "1e-6", "--json"]
    assert main(["epsilon", "--noise-multiplier", "1.5", *base]) == 0
    plain = json.loads(capsys.readouterr().out)["epsilon"]
    assert main(["epsilon", "--noise-multiplier", "1.5", "--stats-epsilon", "0.3", *base]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["contribution_stats_epsilon"] == 0.3 and rec["epsilon"] > plain
    extra = (dp_accounting.LaplaceDpEvent(noise_multiplier=1 / 0.3),)
    assert rec["epsilon"] == pytest.approx(epsilon_of("uls", 1.5, 0.02, 50, 1e-6, extra_events=extra), rel=1e-12)
    # calibration with the release needs more noise, and meets the total
    assert main(["calibrate", "--epsilon", "2", *base]) == 0
    sigma_plain = json.loads(capsys.readouterr().out)["noise_multiplier"]
    assert main(["calibrate", "--epsilon", "2", "--stats-epsilon", "0.3", *base]) == 0
    cal = json.loads(capsys.readouterr().out)
    assert cal["noise_multiplier"] > sigma_plain
    assert epsilon_of("uls", cal["noise_multiplier"], 0.02, 50, 1e-6, extra_events=extra) <= 2.0
    # the release alone spends the target: exit 2 with the reason
    assert main(["calibrate", "--epsilon", "0.2", "--stats-epsilon", "0.3", *base]) == 2
    assert "no noise level leaves room for training" in capsys.readouterr().err


@pytest.mark.integration
def test_q_one_with_large_group_is_a_clear_result_not_a_crash(capsys):
    """ELS at q = 1 (every example every step) is a Gaussian of sensitivity G; extreme probes must not crash."""
    args = ["calibrate", "--method", "els", "--delta", "1e-6", "--sampling-rate", "1", "--group-size", "64"]
    assert main([*args, "--epsilon", "0.001", "--steps", "10000"]) == 2
    assert "no noise multiplier up to" in capsys.readouterr().err
    feasible = ["calibrate", "--method", "els", "--delta", "1e-6", "--sampling-rate", "1", "--group-size", "4"]
    assert main([*feasible, "--epsilon", "4", "--steps", "100", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    # q = 1: T Gaussian steps of sensitivity G compose to one of noise sigma / (G sqrt(T))
    one = epsilon_of("uls", rec["noise_multiplier"] / 4 / 10, 1.0, 1, 1e-6)
    assert rec["epsilon_achieved"] <= 4.0 and one == pytest.approx(rec["epsilon_achieved"], rel=2e-3)


def test_group_size_with_uls_is_refused(capsys):
    assert main(["epsilon", "--method", "uls", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps", "10",
                 "--delta", "1e-6", "--group-size", "8"]) == 2
    assert "--group-size 8 has no effect with --method uls" in capsys.readouterr().err


def test_selection_options_give_the_released_models_epsilon(capsys):
    """--selection composed --runs k: the epsilon of k runs composed; calibrate meets it, per run below it."""
    base = ["--method", "uls", "--sampling-rate", "0.02", "--steps", "100", "--delta", "1e-6", "--json"]
    assert main(["epsilon", *base, "--noise-multiplier", "1.2", "--selection", "composed", "--runs", "3"]) == 0
    three = json.loads(capsys.readouterr().out)
    assert three["epsilon"] == pytest.approx(epsilon_of("uls", 1.2, 0.02, 300, 1e-6), rel=1e-9)
    assert three["selection"] == {"accounting": "composed", "candidates": 3}
    assert main(["calibrate", *base, "--epsilon", "2", "--selection", "random_stopping", "--runs", "10"]) == 0
    rs = json.loads(capsys.readouterr().out)
    assert rs["epsilon_achieved"] <= 2 and rs["epsilon_per_run"] < 2 and rs["steps"] == 100
    assert rs["selection"]["mean_runs"] == 10 and rs["accountant"].startswith("rdp_")
    assert main(["calibrate", *base, "--epsilon", "2", "--selection", "random_stopping", "--shape", "-1"]) == 2
    assert "shape" in capsys.readouterr().err
    # per_run is one run's epsilon: a number of runs with it is refused, not silently ignored
    assert main(["epsilon", *base, "--noise-multiplier", "1.2", "--runs", "3"]) == 2
    assert "--selection composed" in capsys.readouterr().err


@pytest.mark.integration
def test_every_accountant_is_a_method_choice_and_group_rdp_calibrates(capsys):
    from userdp.cli import build_parser
    from userdp.privacy import mechanism

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["calibrate"]
    choices = next(a for a in sub._actions if a.dest == "method").choices
    assert list(choices) == list(mechanism.ACCOUNTANTS)
    assert main(["calibrate", "--method", "group_rdp", "--epsilon", "4", "--delta", "1e-6", "--sampling-rate", "0.01",
                 "--steps", "200", "--group-size", "4", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["accountant"] == "rdp_poisson_subsampled_gaussian+group_privacy" and rec["epsilon_achieved"] <= 4
    # Calibrated to its own conversion, the baseline needs more noise than the tight accountant at this target.
    assert main(["calibrate", "--method", "els", "--epsilon", "4", "--delta", "1e-6", "--sampling-rate", "0.01",
                 "--steps", "200", "--group-size", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["noise_multiplier"] < rec["noise_multiplier"]
    assert epsilon_of("group_rdp", rec["noise_multiplier"], 0.01, 200, 1e-6, 4) <= 4
