"""The mean-estimation study: grid coverage, calibration cache, choices, config errors."""

import itertools
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from userdp.config import validate_config
from userdp.errors import ConfigError
from userdp.experiments import mean_estimation as me
from userdp.privacy.contributions import ExactCounts

TINY = {
    "dimension": 4, "n_users": 200, "contributions_median": 4, "contributions_sigma": 0.8,
    "inter_user_spread": 0.5, "diversities": [0.1, 5.0], "epsilons": [1, 4, 8],
    "budgets": [{"compute": 400, "steps": 10}, {"compute": 1600, "steps": 10}],
    "group_sizes": [1, 2, 8], "learning_rates": [0.1, 0.5], "seeds": [0, 1], "tuning_seeds": [0],
}


def spec_for(over=None):
    cfg = validate_config({"datasets": {"x": {"source": "synthetic"}}, "mean_estimation": {**TINY, **(over or {})}})
    return me.MeanEstimationSpec.from_config(cfg)


class FakeCalibrator:
    """Counts calls; sigma grows with q*G and shrinks with epsilon (shape only)."""

    def __init__(self):
        self.calls = []

    def __call__(self, method, epsilon, delta, sampling_rate, steps, group_size=1):
        self.calls.append((method, epsilon, delta, sampling_rate, steps, group_size))
        return SimpleNamespace(noise_multiplier=(1 + 10 * sampling_rate * group_size) / epsilon,
                               epsilon_achieved=epsilon * 0.999)


@pytest.fixture(scope="module")
def study():
    spec = spec_for()
    fake = FakeCalibrator()
    cal = me.calibrate_cells(me.plan_calibrations(spec), calibrate_fn=fake)
    results, sweep = me.run_study(spec, cal)
    return spec, fake, cal, results, sweep


def test_delta_defaults_to_one_over_n_to_the_1_1():
    assert spec_for().delta == pytest.approx(200 ** -1.1)
    assert spec_for({"delta": 1e-4}).delta == 1e-4


def test_each_distinct_calibration_is_computed_once(study):
    spec, fake, cal, _, _ = study
    assert len(fake.calls) == len(set(fake.calls))
    # ULS accounting ignores G; ELS passes its G to the mixture accountant.
    assert {c[5] for c in fake.calls if c[0] == "uls"} == {1}
    assert {c[5] for c in fake.calls if c[0] == "els"} == {1, 2, 4, 8}
    assert all(c[2] == spec.delta for c in fake.calls)


def test_sampling_rates_follow_the_compute_budget(study):
    spec, _, cal, _, _ = study
    counts = spec.counts()
    for r in cal.itertuples():
        kept = np.minimum(counts, r.group_size)
        if r.method == "els":
            assert r.expected_batch == pytest.approx(r.compute_budget / r.steps)
            assert r.sampling_rate == pytest.approx(r.expected_batch / kept.sum())
        else:
            assert r.expected_batch * r.steps * kept.mean() == pytest.approx(r.compute_budget)
            assert r.sampling_rate == pytest.approx(r.expected_batch / len(counts))


def test_rows_cover_the_requested_grid(study):
    spec, _, _, results, _ = study
    med = ExactCounts(spec.counts()).median_group_size()
    assert med == 4 and med not in spec.group_sizes  # ELS adds its median G to the sweep
    expected = set()
    for eps, (k, _), s, seed in itertools.product(spec.epsilons, spec.budgets, spec.diversities, spec.seeds):
        for g in spec.group_sizes:
            expected.add(("uls", eps, k, s, g, seed))
        expected.add(("els", eps, k, s, med, seed))
    for (k, _), s, seed, g in itertools.product(spec.budgets, spec.diversities, spec.seeds, spec.group_sizes):
        expected.add(("els", spec.sweep_epsilon, k, s, g, seed))
    got = list(zip(results.method, results.epsilon, results.compute_budget, results.diversity,
                   results.group_size, results.seed))
    assert len(got) == len(set(got)) == len(expected)
    assert set(got) == expected
    assert results["squared_error"].gt(0).all() and np.isfinite(results["squared_error"]).all()
    for col in ("noise_multiplier", "sampling_rate", "steps", "expected_batch", "group_size_rule", "learning_rate"):
        assert results[col].notna().all(), col


def test_one_chosen_group_size_per_method_and_cell(study):
    spec, _, _, results, _ = study
    med = ExactCounts(spec.counts()).median_group_size()
    chosen = results[results["chosen"]]
    per = chosen.groupby(["method", "epsilon", "compute_budget", "diversity", "seed"])["group_size"].nunique()
    assert (per == 1).all()
    assert len(per) == 2 * len(spec.epsilons) * len(spec.budgets) * len(spec.diversities) * len(spec.seeds)
    assert set(chosen[chosen.method == "els"].group_size) == {med}
    assert set(chosen.group_size_rule) == {"median", "best_of_sweep"}


def test_choices_use_the_tuning_seeds(study):
    _, _, _, results, sweep = study
    tuning = sweep[sweep.phase == "tuning"]
    cell = ["method", "epsilon", "compute_budget", "diversity", "group_size"]
    best = tuning.loc[tuning.groupby(cell)["squared_error"].idxmin(), cell + ["learning_rate"]]
    merged = results.merge(best, on=cell, suffixes=("", "_tuned"))
    assert len(merged) == len(results)
    assert (merged.learning_rate == merged.learning_rate_tuned).all()
    # ULS's chosen G minimises the tuning error at its tuned learning rate.
    uls = results[(results.method == "uls") & results.chosen].drop_duplicates(["epsilon", "compute_budget", "diversity"])
    for r in uls.itertuples():
        t = results[(results.method == "uls") & (results.epsilon == r.epsilon)
                    & (results.compute_budget == r.compute_budget) & (results.diversity == r.diversity)]
        assert r.tuning_squared_error == pytest.approx(t.tuning_squared_error.min())


def test_reruns_reproduce_and_seeds_differ(study):
    spec, _, cal, results, _ = study
    again, _ = me.run_study(spec, cal)
    pd.testing.assert_frame_equal(results, again)
    a = results[results.seed == 0].squared_error.to_numpy()
    b = results[results.seed == 1].squared_error.to_numpy()
    assert not np.allclose(a, b)


def test_summary_ratio_table(study):
    spec, _, _, results, _ = study
    ratio = me.uls_over_els(results)
    assert len(ratio) == len(spec.epsilons) * len(spec.budgets) * len(spec.diversities)
    assert (ratio.uls_over_els > 0).all()


def test_stale_calibration_is_refused(study):
    _, _, cal, _, _ = study
    with pytest.raises(ConfigError, match="rerun the calibration"):
        me.run_study(spec_for({"n_users": 300}), cal)


def test_budget_larger_than_the_pool_is_a_config_error():
    with pytest.raises(ConfigError, match="mean_estimation.budgets"):
        me.plan_calibrations(spec_for({"budgets": [{"compute": 10 ** 6, "steps": 10}]}))


def test_group_sweep_epsilon_must_be_in_epsilons():
    with pytest.raises(ConfigError, match="group_sweep_epsilon"):
        spec_for({"group_sweep_epsilon": 3})
    assert spec_for({"group_sweep_epsilon": 8}).sweep_epsilon == 8
