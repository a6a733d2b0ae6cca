"""DP-AdamBC (training.optimizer: adam_bc): its update is the reference formula of Tang, Shpilevskiy and
Lecuyer (AAAI 2024) step by step, and the noise variance it subtracts is the privatised update's own,
(sigma C / q N)^2, in the pipeline's engine (ELS and ULS) and through make_private. Post-processing: the
mechanism (sampling, clipping, noise) and so the guarantee are the same as Adam's run."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from train_fixtures import plan_for, run_settings, tiny_model, train_pool
from userdp.errors import ConfigError
from userdp.privacy.spec import PRIVATE_SIZES
from userdp.training import engine, run_seeds, step
from userdp.training.optim import ADAM_BC_FLOOR, AdamBC, make_optimizer


def _reference(theta0, grads, lr, b1, b2, noise_std, floor):
    """The paper's update in float64 numpy, one step at a time."""
    theta, m, v = theta0.copy(), np.zeros_like(theta0), np.zeros_like(theta0)
    out = []
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        theta = theta - lr * m_hat / np.sqrt(np.maximum(v_hat - noise_std ** 2, floor))
        out.append(theta.copy())
    return out


@pytest.mark.parametrize("noise_std", [0.0, 0.05, 0.5])
def test_the_update_is_the_reference_formula(noise_std):
    rng = np.random.default_rng(0)
    theta0 = rng.normal(size=(5, 3))
    grads = [rng.normal(scale=0.5, size=(5, 3)) for _ in range(6)]
    p = torch.nn.Parameter(torch.tensor(theta0))
    opt = AdamBC([p], lr=0.01, betas=(0.8, 0.95), noise_std=noise_std, floor=1e-6)
    want = _reference(theta0, grads, 0.01, 0.8, 0.95, noise_std, 1e-6)
    for g, w in zip(grads, want):
        p.grad = torch.tensor(g)
        opt.step()
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-15)
    if noise_std:  # the correction bites: plain Adam would move elsewhere
        q = torch.nn.Parameter(torch.tensor(theta0))
        adam = torch.optim.Adam([q], lr=0.01, betas=(0.8, 0.95))
        for g in grads:
            q.grad = torch.tensor(g)
            adam.step()
        assert not np.allclose(q.detach().numpy(), want[-1])


def test_a_varying_noise_subtracts_the_average_of_the_steps_variances():
    """Adaptive clipping and banded noise change the update's noise every step: v_hat's noise part is then the
    b2-weighted average of the steps' variances, and that is what is subtracted (a checkpoint keeps it)."""
    rng = np.random.default_rng(1)
    theta0 = rng.normal(size=(4, 2))
    grads = [rng.normal(scale=0.5, size=(4, 2)) for _ in range(6)]
    stds = [0.3, 0.1, 0.6, 0.2, 0.4, 0.05]
    b1, b2, lr, floor = 0.8, 0.9, 0.01, 1e-6
    theta, m, v, avg, want = theta0.copy(), 0.0, 0.0, 0.0, []
    for t, (g, s) in enumerate(zip(grads, stds), 1):
        m, v, avg = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, b2 * avg + (1 - b2) * s * s
        theta = theta - lr * (m / (1 - b1 ** t)) / np.sqrt(np.maximum(v / (1 - b2 ** t) - avg / (1 - b2 ** t),
                                                                        floor))
        want.append(theta.copy())
    p = torch.nn.Parameter(torch.tensor(theta0))
    opt = AdamBC([p], lr=lr, betas=(b1, b2), floor=floor)
    for i, (g, s, w) in enumerate(zip(grads, stds, want)):
        if i == 3:  # stop and resume from the state
            saved = copy.deepcopy(opt.state_dict())
            p = torch.nn.Parameter(p.detach().clone())
            opt = AdamBC([p], lr=lr, betas=(b1, b2), floor=floor)
            opt.load_state_dict(saved)
        opt.bind_noise(s, varying=True)
        p.grad = torch.tensor(g)
        opt.step()
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-15)
    # subtracting only the current step's variance (the constant formula) would have moved elsewhere
    q = torch.nn.Parameter(torch.tensor(theta0))
    const = AdamBC([q], lr=lr, betas=(b1, b2), floor=floor)
    for g, s in zip(grads, stds):
        const.noise_std, const.noise_varies = s, False
        q.grad = torch.tensor(g)
        const.step()
    assert not np.allclose(q.detach().numpy(), want[-1], rtol=1e-6)


def test_state_round_trips_and_another_plans_state_is_refused():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = AdamBC([p], lr=0.1, noise_std=0.2)
    p.grad = torch.full_like(p, 0.3)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    again = AdamBC([q], lr=0.1, noise_std=0.2)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # a checkpoint holds copies
    for o, x in ((opt, p), (again, q)):
        x.grad = torch.full_like(x, -0.1)
        o.step()
    assert torch.equal(p, q)
    with pytest.raises(ConfigError, match="noise_std 0.2 is not this run's 0.3"):
        AdamBC([q], lr=0.1, noise_std=0.3).load_state_dict(opt.state_dict())


def test_a_missing_noise_std_and_bad_settings_are_refused():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ConfigError, match="noise_std is not set"):
        AdamBC([p]).step()
    with pytest.raises(ConfigError, match="floor is 0"):
        AdamBC([p], noise_std=0.1, floor=0)
    assert isinstance(make_optimizer([p], "adam_bc", 0.1), AdamBC) and ADAM_BC_FLOOR == 1e-8


@pytest.mark.parametrize("method,sigma,clip", [("els", 0.8, 0.5), ("uls", 1.3, 1.0), ("uls", 0.0, None)])
def test_the_engine_gives_it_the_updates_noise(method, sigma, clip, tmp_path):
    pool = train_pool(30, seed=1)
    plan = plan_for(pool, method, expected=4.0, steps=3, sigma=sigma, clip=clip)
    seeds = run_seeds.run_seeds(0, 0, "tiny", method, "8", 12, 3, 1e-2, secret=False)
    run = engine.setup(tiny_model(), pool, plan, run_settings(optimizer="adam_bc"), None, seeds, 0)
    opt = run.state.optimizer
    n = pool.n_examples if method == "els" else pool.n_users
    expected = 0.0 if clip is None else sigma * clip / (plan.sampling_rate * n)
    assert isinstance(opt, AdamBC) and opt.noise_std == pytest.approx(expected, rel=1e-12)
    for _ in range(plan.steps):
        run.advance()
    assert all(torch.isfinite(p).all() for p in run.state.params)


@pytest.mark.parametrize("policy", ["pool", "planned"])
def test_the_subtracted_variance_is_the_variance_of_the_noise_the_update_holds(policy):
    """Measured: the noise the engine adds, divided as the update is, has the std the optimizer subtracts."""
    import dataclasses

    pool = train_pool(30, seed=1)
    plan = plan_for(pool, "uls", expected=4.0, steps=2, sigma=1.3, clip=0.7)
    if policy == "planned":  # the divisor is the plan's public expected batch (DP contribution statistics)
        stats = {"private": True, "dp_event": {"type": "LaplaceDpEvent", "noise_multiplier": 5.0}}
        plan = dataclasses.replace(plan, planning_sizes=PRIVATE_SIZES, expected_batch=5.5, contribution_stats=stats)
    seen = []
    seeds = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 12, 3, 1e-2, secret=False)
    run = engine.setup(tiny_model(), pool, plan, run_settings(optimizer="adam_bc"), None, seeds, 0,
                       hook=step.Observer(seen.append))
    run.advance()
    run.advance()
    noise = torch.cat([n.flatten() for o in seen for n in o.noise]).double() / run.step.expected
    assert run.step.expected == (5.5 if policy == "planned" else pytest.approx(4.0))
    assert noise.numel() > 8_000  # std's relative standard error < 0.8%: 3% is about 4 of them
    assert float(noise.std()) == pytest.approx(run.state.optimizer.noise_std, rel=0.03)


@pytest.mark.integration
def test_a_trainer_with_adam_bc_gets_the_plans_noise(tmp_path):
    """Trainer wraps the optimizer (accelerate); the run still binds the noise, and a wrong one is refused."""
    import userdp
    from test_api import checkpoint, users_frame
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    ckpt = checkpoint(tmp_path / "ckpt")
    privacy = userdp.PrivacyArguments(method="els", epsilon=4.0, compute=200, user_column="author",
                                      text_column="body", secret_seeds=False)

    def trainer(opt):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, max_grad_norm=0.0, report_to=[],
                                 use_cpu=True, disable_tqdm=True, save_strategy="no")
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        return userdp.UserDPTrainer(model=model, args=args, train_dataset=users_frame(),
                                    processing_class=AutoTokenizer.from_pretrained(ckpt), privacy=privacy,
                                    optimizers=(opt(model), None))
    t = trainer(lambda m: AdamBC(m.parameters(), lr=1e-3))
    t.train()
    spec = t.spec
    assert t.optimizer.optimizer.noise_std == pytest.approx(
        spec.noise_multiplier * spec.clip_norm / spec.expected_batch, rel=1e-6)
    with pytest.raises(ConfigError, match=r"AdamBC\.noise_std is 0\.5, but the noise in this run's update"):
        trainer(lambda m: AdamBC(m.parameters(), lr=1e-3, noise_std=0.5)).train()


def test_make_private_fills_in_the_plans_noise(tmp_path):
    import userdp
    from test_api import checkpoint, users_frame
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    opt = AdamBC(model.parameters(), lr=1e-3)
    dp = userdp.make_private(model, opt, data=users_frame(), user_column="author", text_column="body",
                             tokenizer=AutoTokenizer.from_pretrained(ckpt), method="els", epsilon=4.0,
                             compute=300, steps=3, secret_seeds=False)
    spec = dp.spec
    assert opt.noise_std == pytest.approx(spec.noise_multiplier * spec.clip_norm / spec.expected_batch, rel=1e-6)
    dp.step()
