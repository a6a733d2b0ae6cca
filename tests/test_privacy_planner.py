"""The planner: derived batch sizes, compute parity, G rules, errors."""

import math

import numpy as np
import pytest

from userdp.errors import ConfigError, PrivacyError
from userdp.privacy.contributions import ExactCounts, clipping_survival
from userdp.privacy.group_size import snr_group_size

from privacy_helpers import epsilon_of
from userdp.privacy.planner import default_delta, plan_cell

PRIVACY = {
    "delta": None, "delta_exponent": 1.1, "clip_norm": 1.0, "clipping": "flat", "max_noise_multiplier": 500,
    "calibration_tolerance": 1e-3,
    "group_size": {"els": "median", "uls": "snr", "snr_noise_ratio": 1.0, "snr_max_quantile": 0.99},
}


@pytest.fixture(scope="module")
def counts():
    rng = np.random.default_rng(0)
    return np.clip(np.round(np.exp(rng.normal(np.log(6), 1.0, 3000))), 1, 200).astype(int)


@pytest.mark.integration
@pytest.mark.parametrize("method", ["els", "uls"])
def test_expected_compute_equals_budget(counts, method):
    plan = plan_cell(dataset="d", method=method, epsilon=4.0, compute_budget=6000, steps=40, counts=counts, privacy=PRIVACY)
    assert plan.expected_compute == pytest.approx(6000, rel=1e-12)
    st = ExactCounts(counts)
    G = plan.group_size
    if method == "els":
        assert plan.expected_batch == pytest.approx(6000 / 40)
        assert plan.sampling_rate == pytest.approx(plan.expected_batch / st.n_bounded(G))
    else:
        assert plan.expected_batch == pytest.approx(6000 / (40 * st.mean_bounded(G)))
        assert plan.sampling_rate == pytest.approx(plan.expected_batch / counts.size)
    assert plan.delta == pytest.approx(1 / counts.size**1.1)
    assert plan.n_train_examples_bounded == st.n_bounded(G)
    # The plan's sigma reaches the plan's epsilon under the plan's accountant.
    eps = epsilon_of(method, plan.noise_multiplier, plan.sampling_rate, 40, plan.delta, plan.group_size)
    assert eps <= 4.0 and eps == pytest.approx(plan.epsilon_achieved)
    for key in ("method", "epsilon", "delta", "group_size", "sampling_rate", "steps", "expected_batch", "noise_multiplier",
                "epsilon_achieved", "compute_budget", "accountant", "group_size_rule", "clip_norm", "clipping"):
        assert key in plan.to_record()


@pytest.mark.integration
def test_els_group_size_is_the_median(counts):
    plan = plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=6000, steps=40, counts=counts, privacy=PRIVACY)
    # The lower median: a count some user has (one definition for exact counts, the DP histogram and the
    # mean-estimation study; docs/method.md section 7).
    assert plan.group_size == ExactCounts(counts).median_group_size() == int(np.sort(counts)[(counts.size - 1) // 2])


@pytest.mark.integration
def test_nonprivate_cell(counts):
    plan = plan_cell(dataset="d", method="uls", epsilon=math.inf, compute_budget=6000, steps=40, counts=counts,
                     privacy=PRIVACY, reference_epsilon=4.0)
    assert plan.noise_multiplier == 0.0 and plan.clip_norm is None and math.isinf(plan.epsilon)
    private = plan_cell(dataset="d", method="uls", epsilon=4.0, compute_budget=6000, steps=40, counts=counts, privacy=PRIVACY)
    assert plan.group_size == private.group_size


@pytest.mark.integration
def test_explicit_and_fixed_group_size(counts):
    plan = plan_cell(dataset="d", method="uls", epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                     privacy=PRIVACY, group_size=16)
    assert plan.group_size == 16 and "explicit" in plan.group_size_rule
    fixed = {**PRIVACY, "group_size": {**PRIVACY["group_size"], "els": 3}}
    assert plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=6000, steps=40, counts=counts,
                     privacy=fixed).group_size == 3
    bad = {**PRIVACY, "group_size": {**PRIVACY["group_size"], "els": "snr"}}
    with pytest.raises(ConfigError, match="privacy.group_size.els"):
        plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=6000, steps=40, counts=counts, privacy=bad)


def test_sampling_rate_above_one_names_the_cell(counts):
    with pytest.raises(PrivacyError) as err:
        plan_cell(dataset="d", method="els", epsilon=4.0, compute_budget=10**7, steps=10, counts=counts, privacy=PRIVACY)
    assert "cell dataset=d method=els eps=4 budget=10000000" in str(err.value)
    assert "more steps" in str(err.value)


@pytest.mark.integration
def test_snr_rule_is_the_argmax_of_its_formula(counts):
    K, T, eps, delta = 60000, 50, 2.0, default_delta(counts.size)
    choice = snr_group_size(ExactCounts(counts), len(counts), K, T, eps, delta, noise_ratio=4.0)
    cands = ExactCounts(counts).group_size_candidates(0.99)
    assert [r["group_size"] for r in choice.table] == cands
    # Recompute one row by hand.
    row = next(r for r in choice.table if r["group_size"] == 4)
    M = K / (T * ExactCounts(counts).mean_bounded(4))
    expected = M * clipping_survival(np.minimum(counts, 4), 4.0).mean() / row["noise_multiplier"]
    assert row["snr"] == pytest.approx(expected)
    best = max((r for r in choice.table if r["snr"] is not None), key=lambda r: r["snr"])
    assert choice.group_size == best["group_size"]


def test_snr_rule_prefers_larger_groups_when_noise_dominates(counts):
    # Large budget (many users per step), small epsilon: the noise term dominates
    # and averaging more examples per user pays off.
    choice = snr_group_size(ExactCounts(counts), len(counts), 200000, 20, 0.5, 1e-6, noise_ratio=4.0)
    assert choice.group_size > 1


def test_dataset_without_validation_or_test_users_fails_at_plan_time():
    from userdp.errors import DataError
    from userdp.privacy.planner import check_evaluation_users

    check_evaluation_users({"n_users": {"train": 10, "validation": 1, "test": 2}}, "d", "c.json")
    with pytest.raises(DataError, match=r"c.json: dataset 'd' has no validation users.*datasets.d.split.validation"):
        check_evaluation_users({"n_users": {"train": 10, "validation": 0, "test": 2}}, "d", "c.json")
    with pytest.raises(DataError, match=r"no validation and no test users"):
        check_evaluation_users({"n_users": {"train": 10}}, "d", "c.json")


def test_delta_not_well_below_one_over_n_is_warned_with_a_fix():
    from userdp.privacy.planner import delta_warning

    warn = delta_warning(1 / 163 ** 1.1, 163, "1/N_train_users^1.1")
    assert warn is not None and "163 train users" in warn and "privacy.delta" in warn and "6e-05" in warn
    assert delta_warning(1e-6, 163, "privacy.delta") is None
    assert delta_warning(1 / 20000 ** 1.1, 20000, "1/N_train_users^1.1") is None  # 20000^-0.1 = 0.37


def test_a_group_size_above_every_users_count_is_explained():
    import numpy as np

    from userdp.privacy.contributions import ExactCounts
    from userdp.privacy.planner import group_size_note

    counts = np.array([1, 3, 60, 5])
    note = group_size_note("els", 1000, counts, ExactCounts(counts))
    assert "G = 1000 but the largest train user has 60 examples" in note and "G = 60" in note and "noise" in note
    assert "ULS clips each user" in group_size_note("uls", 1000, counts, ExactCounts(counts))
    assert group_size_note("els", 60, counts, ExactCounts(counts)) is None
