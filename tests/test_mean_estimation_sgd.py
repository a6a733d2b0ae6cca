"""DP-SGD-ELS / DP-SGD-ULS on the quadratic loss: sampling, clipping, noise, fixed points."""

import math

import numpy as np
import pytest
from scipy import stats

from userdp.experiments.mean_estimation_population import Population, contribution_counts
from userdp.experiments.mean_estimation_sgd import clipped_noisy_gd, poisson_indices, run_els, run_uls


def rngs(a=0, b=1):
    return dict(rng_sample=np.random.default_rng(a), rng_noise=np.random.default_rng(b))


@pytest.fixture(scope="module")
def pool():
    counts = contribution_counts(300, 4, 1.0, seed=3)
    assert counts.min() < 4 < counts.max()  # heterogeneous users, so the two fixed points differ
    pop = Population(counts, dimension=5, inter_user_spread=1.0, max_group_size=8, seed=0)
    return pop.bounded(diversity=2.0, group_size=8)


def test_poisson_sample_sizes_vary_with_binomial_mean_and_variance():
    rng = np.random.default_rng(0)
    n, q, reps = 2000, 0.05, 3000
    sizes = np.array([poisson_indices(rng, n, q).size for _ in range(reps)])
    assert np.unique(sizes).size > 10  # realised batches vary; never a fixed size
    se = math.sqrt(n * q * (1 - q) / reps)
    assert abs(sizes.mean() - n * q) < 4 * se
    assert sizes.var(ddof=1) == pytest.approx(n * q * (1 - q), rel=0.12)


def test_poisson_inclusion_is_uniform_and_independent_of_position():
    rng = np.random.default_rng(1)
    n, q, reps = 500, 0.1, 4000
    hits = np.zeros(n)
    for _ in range(reps):
        idx = poisson_indices(rng, n, q)
        assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < n
        hits[idx] += 1
    # Each index is Binomial(reps, q): a chi-square test of the counts.
    expected = reps * q
    chi2 = (((hits - expected) ** 2) / (expected * (1 - q))).sum()
    assert stats.chi2.sf(chi2, n) > 1e-3
    assert poisson_indices(rng, n, 1.0).size == n and poisson_indices(rng, n, 0.0).size == 0


def test_els_without_noise_or_clipping_converges_to_pool_mean(pool):
    res = run_els(pool, sampling_rate=1.0, noise_multipliers=[0.0], clip_norm=math.inf,
                  expected_batch=pool.pool_size, steps=60, learning_rates=[0.5], **rngs())
    target = pool.examples.mean(axis=0)
    np.testing.assert_allclose(res.theta[0, 0], target, rtol=0, atol=1e-12)
    # ... which is not the average of user means (users with more examples weigh more).
    assert np.linalg.norm(target - pool.user_means.mean(axis=0)) > 1e-2


def test_uls_without_noise_or_clipping_converges_to_average_of_user_means(pool):
    res = run_uls(pool, sampling_rate=1.0, noise_multipliers=[0.0], clip_norm=math.inf,
                  expected_batch=len(pool.kept), steps=60, learning_rates=[0.5], **rngs())
    np.testing.assert_allclose(res.theta[0, 0], pool.user_means.mean(axis=0), rtol=0, atol=1e-12)
    # Full participation processes every kept example once per step.
    assert res.realised_compute == 60 * pool.pool_size


def test_update_divides_by_expected_not_realised_batch():
    pts = np.array([[1.0, 2.0], [3.0, -2.0]])
    res = clipped_noisy_gd(pts, sampling_rate=1.0, noise_multipliers=[0.0], clip_norm=math.inf,
                           expected_batch=8.0, steps=1, learning_rates=[1.0], **rngs())
    np.testing.assert_allclose(res.theta[0, 0], pts.sum(0) / 8.0)


def test_per_point_clipping_bounds_each_gradient():
    pts = np.array([[10.0, 0.0], [0.0, 0.5]])  # norms 10 (clipped to 1) and 0.5 (kept)
    res = clipped_noisy_gd(pts, sampling_rate=1.0, noise_multipliers=[0.0], clip_norm=1.0,
                           expected_batch=1.0, steps=1, learning_rates=[1.0], **rngs())
    np.testing.assert_allclose(res.theta[0, 0], [1.0, 0.5])


def test_noise_is_sigma_times_clip_norm_and_fresh_every_step():
    d, sigma, clip = 4, 2.5, 0.4
    pts = np.zeros((3, d))
    res = clipped_noisy_gd(pts, sampling_rate=1e-12, noise_multipliers=[sigma, 0.5 * sigma], clip_norm=clip,
                           expected_batch=1.0, steps=2, learning_rates=[1.0], **rngs(0, 42))
    z = np.random.default_rng(42).standard_normal((2, d))
    # theta_2 = -(noise_1 + noise_2): two different draws, each sigma * C * z.
    np.testing.assert_allclose(res.theta[0, 0], -(z[0] + z[1]) * sigma * clip, rtol=1e-12)
    np.testing.assert_allclose(res.theta[1, 0], -(z[0] + z[1]) * 0.5 * sigma * clip, rtol=1e-12)
    assert not np.allclose(z[0], z[1])


def test_noise_std_statistically():
    d, sigma, clip = 40000, 1.7, 0.3
    res = clipped_noisy_gd(np.zeros((2, d)), sampling_rate=1e-12, noise_multipliers=[sigma], clip_norm=clip,
                           expected_batch=1.0, steps=1, learning_rates=[1.0], **rngs(0, 7))
    assert res.theta[0, 0].std() == pytest.approx(sigma * clip, rel=0.02)
    assert abs(res.theta[0, 0].mean()) < 5 * sigma * clip / math.sqrt(d)


def test_uls_realised_compute_counts_kept_examples_of_sampled_users(pool):
    q, steps = 0.2, 50
    m = len(pool.kept) * q  # expected cohort size
    res = run_uls(pool, sampling_rate=q, noise_multipliers=[1.0], clip_norm=1.0, expected_batch=m,
                  steps=steps, learning_rates=[0.1], **rngs(5, 6))
    expected = steps * q * pool.pool_size
    assert res.realised_compute / expected == pytest.approx(1.0, abs=0.1)
    assert res.batch_sizes.std() > 0
