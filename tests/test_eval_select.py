"""Learning-rate selection: lowest validation loss wins, the chosen run's files are copied."""

import math

import pandas as pd
import pytest

from userdp.evaluation.select import choose_learning_rate, pretrained_metrics, select, select_cell
from userdp.io import read_json, write_json
from privacy_helpers import epsilon_of
from userdp.errors import DataError


def ev(val, test):
    return {"validation_loss": val, "test_loss": test, "test_loss_user_macro": test + 0.1,
            "test_perplexity": math.exp(test), "test_accuracy": 0.3, "validation_accuracy": 0.3}


def test_picks_minimum_validation_loss_not_test_loss():
    evals = {0.001: ev(3.0, 2.0), 0.01: ev(2.5, 2.9), 0.1: ev(2.7, 1.0)}
    out = select(evals)
    assert out["learning_rate"] == 0.01
    assert out["test_loss"] == 2.9  # reported on test users, chosen on validation users
    assert out["validation_loss"] == 2.5
    assert [r["learning_rate"] for r in out["learning_rate_sweep"]] == [0.001, 0.01, 0.1]
    assert [r["validation_loss"] for r in out["learning_rate_sweep"]] == [3.0, 2.5, 2.7]


def test_diverged_runs_never_win_and_ties_go_to_the_smaller_rate():
    assert choose_learning_rate({0.1: math.nan, 0.01: 4.0, 1.0: "inf"}) == 0.01
    assert choose_learning_rate({0.1: 2.0, 0.01: 2.0}) == 0.01
    assert choose_learning_rate({0.1: math.nan, 0.3: math.nan}) == 0.1


def test_select_cell_writes_metrics_and_copies_the_chosen_run(tmp_path):
    lrs = [0.001, 0.01]
    evals, ledgers, logs = [], [], []
    for lr, val in zip(lrs, (3.0, 2.0)):
        d = tmp_path / f"lr~{lr}"
        write_json(d / "eval.json", ev(val, val - 0.5))
        write_json(d / "ledger.json", {"which": lr, **MECH})
        pd.DataFrame({"step": [1, 2], "update_signal_norm": [lr, lr], "loss": [lr, lr]}).to_parquet(
            d / "train_log.parquet")
        evals.append(str(d / "eval.json"))
        ledgers.append(str(d / "ledger.json"))
        logs.append(str(d / "train_log.parquet"))
    select_cell(lrs, evals, ledgers, logs, str(tmp_path / "metrics.json"), str(tmp_path / "ledger.json"),
                str(tmp_path / "train_log.parquet"))
    m = read_json(tmp_path / "metrics.json")
    assert m["learning_rate"] == 0.01 and m["test_loss"] == 1.5
    for k in ("test_loss", "test_loss_user_macro", "test_perplexity", "test_accuracy", "validation_loss"):
        assert k in m
    led = read_json(tmp_path / "ledger.json")
    assert led["which"] == 0.01 and led["learning_rates_tried"] == 2
    # two independent runs composed: 2T steps of the mechanism
    assert led["epsilon"] == pytest.approx(
        epsilon_of("uls", MECH["noise_multiplier"], MECH["sampling_rate"], 2 * MECH["steps_completed"],
                        MECH["delta"]), rel=1e-9)
    assert led["epsilon_one_run"] == MECH["epsilon"] and led["epsilon"] > 1.2 * led["epsilon_one_run"]
    assert "2 learning-rate runs composed" in led["epsilon_meaning"]
    cell_log = pd.read_parquet(tmp_path / "train_log.parquet")
    assert cell_log["update_signal_norm"].tolist() == [0.01, 0.01]  # the chosen run's log
    assert "loss" not in cell_log.columns  # a noise-free per-step value: only with training.debug_step_log


def test_pretrained_metrics_have_the_same_fields_with_null_learning_rate():
    cell = select({0.01: ev(2.0, 2.1)})
    pre = pretrained_metrics(ev(4.0, 4.1))
    assert set(cell) == set(pre)
    assert pre["learning_rate"] is None and pre["test_loss"] == 4.1


MECH = {"method": "uls", "sampling_rate": 0.05, "noise_multiplier": 1.1, "clip_norm": 1.0, "group_size": 4,
        "delta": 1e-5, "steps_completed": 100}
MECH["epsilon"] = epsilon_of("uls", 1.1, 0.05, 100, 1e-5)


def test_selection_epsilon_one_rate_nonprivate_and_mismatch(tmp_path):
    from userdp.evaluation.select import with_selection_epsilon

    one = with_selection_epsilon(MECH, [MECH], ["a"])
    assert one["learning_rates_tried"] == 1 and one["epsilon"] == MECH["epsilon"] == one["epsilon_one_run"]
    nonpriv = dict(MECH, noise_multiplier=0.0, epsilon=math.inf)
    assert with_selection_epsilon(nonpriv, [nonpriv, nonpriv], ["a", "b"])["epsilon"] == math.inf
    with pytest.raises(DataError, match=r"b: the learning-rate runs of this cell ran different mechanisms \(noise_multiplier"):
        with_selection_epsilon(MECH, [MECH, dict(MECH, noise_multiplier=2.0)], ["a", "b"])


def test_a_composed_plan_refuses_a_different_number_of_runs():
    """The plan calibrated each run for k composed runs: selecting among another number is an error."""
    from userdp.evaluation.select import with_selection_epsilon

    led = dict(MECH, selection={"accounting": "composed", "candidates": 3})
    with pytest.raises(DataError, match="among 3 learning-rate runs, but 2 ran"):
        with_selection_epsilon(led, [led, led], ["a", "b"])
    out = with_selection_epsilon(led, [led] * 3, ["a", "b", "c"])
    assert out["epsilon"] == pytest.approx(epsilon_of("uls", 1.1, 0.05, 300, 1e-5), rel=1e-9)
    assert out["selection"] == {"accounting": "composed", "candidates": 3}


def test_one_rate_needs_no_validation_but_a_choice_does():
    from userdp.evaluation.select import ONLY_RATE

    test_only = {"test_loss": 2.0, "test_n_users": 3}
    out = select({0.01: dict(test_only)})
    assert out["learning_rate"] == 0.01 and out["selection"] == ONLY_RATE and "validation_loss" not in out
    scored = select({0.01: {**test_only, "validation_loss": 2.1}})
    assert scored["selection"].startswith("lowest validation_loss")
    with pytest.raises(DataError, match="validation_loss"):
        select({0.01: dict(test_only), 0.1: dict(test_only)})
    # several rates: a stale test-only eval of a rate that is not the best is refused too, not silently skipped
    with pytest.raises(DataError, match=r"\['0.1'\] has no validation_loss"):
        select({0.01: {**test_only, "validation_loss": 2.1}, 0.1: dict(test_only)})
