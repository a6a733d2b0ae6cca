"""User-level DP-FTRL with banded correlated noise (privacy.correlated_noise; userdp.privacy.banded).

* the strategy: the banded square root's coefficients, unit column norm, C^-1's row norms and the whitening;
* the accounting: ceil(T / b) rounds of the Poisson-subsampled Gaussian at the within-partition rate p (jax_privacy's
  amplified BandMF event), for the plan, partial runs, k composed learning-rate runs and calibration; the planner's
  p = b m / N and its refusals;
* the sampler: one partition per user by its own keyed hash, a user sampled only at steps of its partition, at rate
  p there, nobody else moved by removing a user;
* the engine against brute force (lr 0, float64): the noise the run added over T steps is sigma C (C^-1 z)_t with
  z the run's own generator's draws, the sampled users are those of the step's partition; the ledger's event is the
  plan's and re-accounts to its epsilon; resume (with AdamBC, whose noise follows the marginal std) equals one run;
  the buffers' memory bound; make_private from PrivacyArguments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from train_fixtures import plan_for, run_settings, tiny_model, train_pool
from userdp.errors import ConfigError, DataError, PrivacyError
from userdp.privacy import banded, mechanism
from userdp.privacy.accounting import epsilon as pld_epsilon
from userdp.privacy.spec import RunSpec
from userdp.training import engine, ledger as ledger_lib, run_seeds, run_state
from userdp.training.sampling import CyclicPoissonSampler
from userdp.training.settings import TrainSettings


def banded_plan(pool, bands: int, *, expected=4.0, steps=7, sigma=0.8, clip=0.05) -> RunSpec:
    """A ULS plan run as b-banded DP-FTRL: the same expected batch m, from one partition: p = b m / N."""
    plan = plan_for(pool, "uls", expected=expected, steps=steps, sigma=sigma, clip=clip)
    return plan.replace(sampling_rate=plan.sampling_rate * bands, correlated_noise={"bands": bands})


# ---------------------------------------------------------------- the strategy


def test_the_banded_square_root_strategy():
    c = banded.bsr_coefficients(5)
    raw = np.array([math.comb(2 * k, k) / 4 ** k for k in range(5)])
    np.testing.assert_allclose(c, raw / np.linalg.norm(raw), rtol=1e-15)
    assert banded.bsr_coefficients(1).tolist() == [1.0]
    C = banded.strategy_matrix(c, 12)
    assert np.all(np.linalg.norm(C, axis=0) <= 1 + 1e-12) and np.linalg.norm(C[:, 0]) == pytest.approx(1.0)
    assert np.count_nonzero(np.tril(C, -5)) == 0 and np.count_nonzero(np.triu(C, 1)) == 0  # 5 bands, lower
    inv = np.linalg.inv(C)
    np.testing.assert_allclose(banded.marginal_std_factors(c, 12), np.linalg.norm(inv, axis=1), rtol=1e-12)
    z = np.random.default_rng(0).normal(size=(12, 3))
    np.testing.assert_allclose(banded.whiten(inv @ z, c), z, atol=1e-12)
    # the anti-correlated noise cancels in running sums: the prefix sums' noise is below DP-SGD's sqrt(t)
    prefix = np.linalg.norm(np.tril(np.ones((12, 12))) @ inv, axis=1)
    assert prefix[-1] < 0.65 * math.sqrt(12)  # 2.10 against 3.46
    for bad in (0, 1, 2.5, True):
        with pytest.raises(PrivacyError, match=r"privacy\.correlated_noise\.bands"):
            banded.CorrelatedNoise(bands=bad)
    with pytest.raises(PrivacyError, match="unknown key"):
        banded.CorrelatedNoise.from_record({"bands": 2, "band": 3})
    with pytest.raises(PrivacyError, match="strategy"):
        banded.CorrelatedNoise.from_record({"bands": 2, "strategy": "blt"})


# ---------------------------------------------------------------- the accounting


def test_the_event_is_amplified_bandmf():
    m = mechanism.BandedULS(0.3, 10, 4, bands=4)
    rounds = mechanism.ULS(0.3, 3, 1)  # ceil(10 / 4) rounds of the subsampled Gaussian at p
    assert m.dp_event(1.1) == rounds.dp_event(1.1)
    assert m.dp_event(1.1, steps=5) == mechanism.ULS(0.3, 2, 1).dp_event(1.1)  # a partial run: ceil(5 / 4)
    assert m.dp_event(1.1, steps=0) == mechanism.ULS(0.3, 1, 1).dp_event(1.1, steps=0)
    assert m.epsilon(1.1, 1e-5) == rounds.epsilon(1.1, 1e-5)
    # k learning-rate runs: each starts its own cycle, k ceil(T / b) rounds (not ceil(k T / b) = 8)
    assert m.repeated(3) == mechanism.ULS(0.3, 9, 1) and m.repeated(1) is m
    assert m.participation_probability() == pytest.approx(1 - 0.7 ** 3)
    with pytest.raises(PrivacyError, match="bands"):
        mechanism.BandedULS(0.3, 10, 4, bands=1)


def test_plan_cell_samples_one_partition_and_calibrates_its_rounds():
    from userdp.privacy.calibration import calibrate
    from userdp.privacy.planner import plan_cell
    from userdp.privacy.selection import Selection

    counts = np.array([3, 5, 8, 2, 9, 4, 6, 7] * 25)
    common = dict(dataset="d", method="uls", epsilon=4.0, compute_budget=2000, steps=20, counts=counts,
                  selection=Selection("composed", 2))
    flat = plan_cell(**common, privacy={"clip_norm": 1.0, "group_size": {"uls": 4}})
    plan = plan_cell(**common, privacy={"clip_norm": 1.0, "group_size": {"uls": 4}, "correlated_noise": {"bands": 3}})
    assert plan.expected_batch == flat.expected_batch and plan.sampling_rate == pytest.approx(3 * flat.sampling_rate)
    assert plan.correlated_noise == {"strategy": "banded_square_root", "bands": 3}
    assert plan.mechanism == mechanism.BandedULS(plan.sampling_rate, 20, 4, bands=3)
    assert plan.dp_event == mechanism.event_to_json(mechanism.ULS(plan.sampling_rate, 7, 1).dp_event(
        plan.noise_multiplier))
    # calibrated for the two runs composed: 2 x ceil(20 / 3) = 14 rounds
    direct = calibrate(mechanism.ULS(plan.sampling_rate, 14, 1), 4.0, plan.delta)
    assert plan.noise_multiplier == direct.noise_multiplier
    assert plan.accountant.endswith("amplified_bandmf") and "amplified_bandmf" not in flat.accountant
    assert RunSpec.from_record(plan.to_record(), "plan.json") == plan and "correlated_noise" not in flat.to_record()
    # ELS and the non-private reference stay DP-SGD
    els = plan_cell(**{**common, "method": "els"}, privacy={"clip_norm": 1.0, "group_size": {"els": 4},
                                                           "correlated_noise": {"bands": 3}})
    ref = plan_cell(**{**common, "epsilon": math.inf}, privacy={"group_size": {"uls": 4},
                                                                 "correlated_noise": {"bands": 3}})
    assert els.correlated_noise is None and ref.correlated_noise is None
    with pytest.raises(PrivacyError, match=r"method=uls eps=4.*rate p = b m / N = .* > 1"):
        plan_cell(**common, privacy={"clip_norm": 1.0, "group_size": {"uls": 4}, "correlated_noise": {"bands": 8}})
    with pytest.raises(DataError, match="plan.json: correlated_noise is recorded for a els plan"):
        RunSpec.from_record({**els.to_record(), "correlated_noise": {"bands": 3}}, "plan.json")
    edited = {**plan.to_record(), "correlated_noise": {"bands": 2}}
    with pytest.raises(DataError, match="plan.json: dp_event is not the event of the recorded mechanism"):
        RunSpec.from_record(edited, "plan.json")


def test_the_snr_rule_predicts_with_the_banded_mechanism():
    """Under banded DP-FTRL the SNR rule's sigma(G) is the cell's own mechanism's (BandedULS at p = b q_u), so
    the G it chooses is the one that maximises the banded run's signal-to-noise; a candidate whose rate within
    a partition would exceed 1 is skipped. Without correlated noise the table is DP-SGD's, as before."""
    from userdp.privacy.calibration import calibrate
    from userdp.privacy.planner import plan_cell

    counts = np.array([1, 2, 3, 5, 8, 13, 21, 30] * 60)
    common = dict(dataset="d", method="uls", epsilon=2.0, compute_budget=4000, steps=20, counts=counts)
    flat = plan_cell(**common, privacy={"clip_norm": 1.0})
    plan = plan_cell(**common, privacy={"clip_norm": 1.0, "correlated_noise": {"bands": 4}})
    assert plan.group_size_rule.startswith("snr") and flat.group_size_rule.startswith("snr")
    by_g = {r["group_size"]: r for r in plan.group_size_candidates}
    flat_by_g = {r["group_size"]: r for r in flat.group_size_candidates}
    assert by_g.keys() == flat_by_g.keys() and len(by_g) >= 3
    skipped = [g for g, r in by_g.items() if r["skipped"]]
    for g, r in by_g.items():
        q_u = flat_by_g[g]["sampling_rate"]
        assert r["sampling_rate"] == pytest.approx(4 * q_u) and r["expected_batch"] == flat_by_g[g]["expected_batch"]
        if 4 * q_u > 1:
            assert r["skipped"].startswith("sampling rate > 1 (the rate within one of 4 partitions)")
            continue
        want = calibrate(mechanism.BandedULS(4 * q_u, 20, 1, bands=4), 2.0, plan.delta, tolerance=3e-3,
                         discretization=1e-3).noise_multiplier
        assert r["noise_multiplier"] == pytest.approx(want, rel=1e-12)
        assert r["noise_multiplier"] != pytest.approx(flat_by_g[g]["noise_multiplier"], rel=1e-3)
    assert skipped and not any(r["skipped"] for r in flat.group_size_candidates if r["group_size"] in skipped)
    best = max((r for r in by_g.values() if r["snr"] is not None), key=lambda r: (r["snr"], -r["group_size"]))
    assert plan.group_size == best["group_size"]


def test_privacy_correlated_noise_changes_only_private_uls_plans():
    from userdp.config import validate_config
    from userdp.privacy.targets import plan_privacy_params

    def params(privacy, method="uls", eps="1"):
        cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}}, "privacy": privacy})
        return plan_privacy_params(cfg, method, eps)

    on = {"correlated_noise": {"bands": 4}}
    assert params(on)["correlated_noise"] == {"bands": 4}
    assert "correlated_noise" not in params({})
    assert params(on, "els") == params({}, "els") and params(on, eps="inf") == params({}, eps="inf")
    with pytest.raises(ConfigError, match="correlated_noise"):
        validate_config({"datasets": {"synth": {"source": "synthetic"}}, "privacy": {"correlated_noise": {"bands": 1}}})


# ---------------------------------------------------------------- the sampler


def test_cyclic_poisson_sampling():
    ids = [f"u{i}" for i in range(3000)]
    b, p, T = 4, 0.3, 40
    s = CyclicPoissonSampler(ids, p, seed=5, bands=b)
    parts = s.partitions.copy()
    assert set(np.unique(parts)) == set(range(b)) and abs(np.bincount(parts).min() / 3000 - 1 / b) < 0.05
    taken = np.zeros((T, len(ids)), bool)
    for t in range(T):
        taken[t, s.sample()] = True
    for t in range(T):  # only the step's partition, each of its users at rate p
        assert not taken[t, parts != t % b].any()
        eligible = parts == t % b
        assert abs(taken[t, eligible].mean() - p) < 5 * math.sqrt(p * (1 - p) / eligible.sum())
    gaps = [np.diff(np.flatnonzero(taken[:, u])) for u in range(len(ids))]
    assert min(g.min() for g in gaps if g.size) == b  # at most once in any b consecutive steps
    # removing a user moves no one: the same partitions and draws for everybody else
    other = CyclicPoissonSampler(ids[:1000] + ids[1001:], p, seed=5, bands=b)
    np.testing.assert_array_equal(other.partitions, np.delete(parts, 1000))
    for t in range(T):
        kept = np.delete(taken[t], 1000)
        assert np.array_equal(np.flatnonzero(kept), other.sample())
    # a resumed sampler continues the same stream; another b is refused
    a, c = CyclicPoissonSampler(ids, p, 5, b), CyclicPoissonSampler(ids, p, 5, b)
    for _ in range(3):
        a.sample()
    c.load_state_dict(a.state_dict())
    assert np.array_equal(a.sample(), c.sample())
    with pytest.raises(ValueError, match="bands"):
        CyclicPoissonSampler(ids, p, 5, 3).load_state_dict(a.state_dict())


# ---------------------------------------------------------------- the engine against brute force


def _settings(**kw) -> TrainSettings:
    base = dict(learning_rate=0.0, optimizer="sgd", schedule="constant", warmup_steps=0, physical_batch_size=8,
                sequence_length=8, checkpoint_every=1000, device="cpu", log_every_s=1e9)
    return TrainSettings(**{**base, **kw})


@pytest.mark.parametrize("bands", [1, 3])
def test_the_noise_over_t_steps_is_c_inverse_z(bands, tmp_path):
    """bands 1 is the control: the same code with plain ULS (C = I) must give z itself."""
    from userdp.training import step

    pool = train_pool(24, seed=3)
    plan = banded_plan(pool, bands) if bands > 1 else plan_for(pool, "uls", expected=4.0, steps=7, sigma=0.8,
                                                                clip=0.05)
    seeds = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 12, 3, 1e-2, secret=False)
    seen: list[step.StepObservation] = []
    model = tiny_model(seed=1).double()
    out = engine.train(model, pool, plan, _settings(), run_state.RunPaths(tmp_path / "run"), seeds, 0,
                       compute_epsilon=pld_epsilon, observe=seen.append)
    assert out.complete and len(seen) == plan.steps

    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(int(seeds["noise"]))
    z = [[torch.randn(p.shape, generator=gen, dtype=torch.float32).double() for p in params] for _ in seen]
    inv = np.linalg.inv(banded.strategy_matrix(banded.bsr_coefficients(bands), plan.steps))
    std = plan.noise_multiplier * plan.clip_norm
    for t, o in enumerate(seen):
        for i, noise in enumerate(o.noise):
            expected = sum(inv[t, j] * z[j][i] for j in range(t + 1)) * std
            torch.testing.assert_close(noise, expected, rtol=1e-5, atol=1e-6)
    if bands > 1:
        sampler = CyclicPoissonSampler(pool.user_ids, plan.sampling_rate, int(seeds["sampler"]), bands)
        for t, o in enumerate(seen):  # every sampled user belongs to the step's partition
            users = np.unique(pool.example_user[np.asarray(o.selection.rows, np.int64)])
            assert np.all(sampler.partitions[users] == t % bands)
        assert sum(len(o.selection.rows) > 0 for o in seen) >= 3
    led = out.ledger
    assert led["dp_event"] == plan.dp_event
    assert ledger_lib.guarantee_epsilon([ledger_lib.run_event(led)], led["delta"], accountant=pld_epsilon) \
        == led["epsilon"] == pytest.approx(pld_epsilon(plan.event, plan.delta), rel=1e-12)
    assert led["expected_batch"] == pytest.approx(4.0)
    if bands > 1:
        assert led["correlated_noise"]["rounds_per_user"] == 3 and len(led["correlated_noise"]["coefficients"]) == 3
        card = (tmp_path / "run" / "README.md").read_text()
        assert "DP-FTRL" in card and "cyclic Poisson" in card
    else:
        assert "correlated_noise" not in led


def test_a_resumed_banded_run_with_adam_bc_equals_one_run_straight_through(tmp_path):
    pool = train_pool(30, seed=1)
    plan = banded_plan(pool, 3, steps=6)
    seeds = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 12, 3, 1e-2, secret=False)
    settings = run_settings(optimizer="adam_bc", checkpoint_every=2)
    outs = []
    for name, stops in (("straight", [None]), ("resumed", [4, None])):
        paths = run_state.RunPaths(tmp_path / name)
        model = tiny_model(seed=2)
        for max_steps in stops:
            model = tiny_model(seed=2)
            out = engine.train(model, pool, plan, settings, paths, seeds, 0, compute_epsilon=pld_epsilon,
                               max_steps=max_steps)
        outs.append((out, model))
    (a, ma), (b, mb) = outs
    assert b.ledger["resumed_at_steps"] == [4] and a.ledger["resumed_at_steps"] == []
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    # a checkpoint of DP-SGD's ULS (other sampling, no buffers) is never resumed as the banded run
    other = plan.replace(correlated_noise={"bands": 2}, sampling_rate=plan.sampling_rate / 3 * 2)
    assert run_state.fingerprint_plan(other) != run_state.fingerprint_plan(plan)
    assert "correlated_noise" not in run_state.fingerprint_plan(plan_for(pool, "uls", expected=4.0, steps=6))


def test_noise_buffers_beyond_the_memory_bound_are_refused_before_any_step(tmp_path):
    pool = train_pool(30, seed=1)
    plan = banded_plan(pool, 3)
    seeds = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 12, 3, 1e-2, secret=False)
    with pytest.raises(PrivacyError, match=r"training\.max_noise_buffers_gb = 1e-06.*Fix: set privacy\.correlated_noise to null \(DP-SGD\)"):
        engine.train(tiny_model(seed=2), pool, plan, _settings(max_noise_buffers_gb=1e-6),
                     run_state.RunPaths(tmp_path / "run"), seeds, 0, compute_epsilon=pld_epsilon)
    assert not (tmp_path / "run" / "ledger.json").exists()


def test_make_private_runs_banded_dp_ftrl_from_privacy_arguments(tmp_path):
    import userdp
    from test_api import checkpoint, users_frame
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    privacy = userdp.PrivacyArguments(method="uls", epsilon=8.0, compute=100, user_column="author",
                                      text_column="body", secret_seeds=False, correlated_noise={"bands": 2})
    dp = userdp.make_private(model, torch.optim.SGD(model.parameters(), lr=1e-3), data=users_frame(),
                             tokenizer=AutoTokenizer.from_pretrained(ckpt), privacy=privacy, steps=4)
    assert dp.spec.banded == banded.CorrelatedNoise(bands=2)
    for _ in range(4):
        dp.step()
    assert dp.ledger()["correlated_noise"]["rounds_per_user"] == 2
    with pytest.raises(ConfigError, match="user-level sampling only"):
        userdp.PrivacyArguments(method="els", epsilon=8.0, compute=100, correlated_noise={"bands": 2})


def test_banded_noise_state_and_marginal_std():
    """The marginal std AdamBC subtracts is sigma C ||row t of C^-1|| at every step; a noise restored from its
    state mid-run continues the same sequence."""
    from userdp.training.noise import BandedNoise

    c = banded.bsr_coefficients(3)
    rows = np.linalg.norm(np.linalg.inv(banded.strategy_matrix(c, 6)), axis=1)
    p = torch.nn.Parameter(torch.zeros(5))
    a, b = BandedNoise(2.0, 0.5, 7, c, 6), BandedNoise(2.0, 0.5, 99, c, 6)
    drawn = []
    for t in range(6):
        assert a.step_std(t) == pytest.approx(1.0 * rows[t], rel=1e-12)
        if t == 3:
            b.load_state_dict(a.state_dict())
        p.grad = torch.zeros(5)
        a.add_([p])
        drawn.append(p.grad.clone())
        assert b.step_std(t) == pytest.approx(1.0 * rows[t], rel=1e-12)  # the step index, not what was drawn
        if t >= 3:
            p.grad = torch.zeros(5)
            b.add_([p])
            torch.testing.assert_close(p.grad, drawn[t], rtol=0, atol=0)
    with pytest.raises(ValueError, match="band coefficients"):
        BandedNoise(2.0, 0.5, 7, banded.bsr_coefficients(2), 6).load_state_dict(a.state_dict())
