"""Adaptive clipping at user level (privacy.clipping: adaptive; userdp.privacy.adaptive).

* the accounting: sigma^-2 = sigma_g^-2 + (2 sigma_b)^-2, so one step of gradient and count is the Gaussian
  mechanism at the plan's sigma (whitened sensitivity, checked numerically), and the plan's event and epsilon
  are those of fixed clipping at that sigma; a count noise that leaves the gradient nothing is refused;
* the engine against a slow loop (lr 0, float64): every step's clip norm C_t, released count s_t and the noise
  added to the gradient (sigma_g C_t) equal a reference that recomputes each sampled unit's norm by brute force
  and draws the noise from its own copy of the run's generator, for ELS and ULS; the train log releases C_t and
  b_t, and the ledger records the settings and re-accounts to the plan's epsilon;
* resume: a run stopped and resumed (with AdamBC, whose noise follows C_t) equals one run straight through.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from train_fixtures import SEQ, plan_for, run_settings, tiny_model, train_pool
from userdp.errors import DataError, PrivacyError
from userdp.privacy import adaptive as adaptive_lib
from userdp.privacy.accounting import epsilon as pld_epsilon
from userdp.privacy.spec import RunSpec
from userdp.training import engine, ledger as ledger_lib, run_seeds, run_state, step
from userdp.training.settings import TrainSettings

SETTINGS = {"quantile": 0.4, "learning_rate": 0.3, "count_noise": 0.2}


def adaptive_plan(pool, method, *, expected=4.0, steps=6, sigma=0.9, clip=0.05, settings=SETTINGS) -> RunSpec:
    plan = plan_for(pool, method, expected=expected, steps=steps, sigma=sigma, clip=clip)
    return plan.replace(clipping="adaptive", adaptive_clipping=dict(settings))


# ---------------------------------------------------------------- the accounting


@pytest.mark.parametrize("sigma,count_noise,divisor", [(1.0, 0.05, 100.0), (0.7, 0.2, 4.0), (3.0, 0.5, 3.1)])
def test_gradient_and_count_together_are_the_gaussian_mechanism_at_sigma(sigma, count_noise, divisor):
    a = adaptive_lib.AdaptiveClipping(count_noise=count_noise)
    sigma_g, sigma_b = a.gradient_noise_multiplier(sigma, divisor), a.count_std(divisor)
    # One unit moves (clipped sum, centred count) by at most (C, 1/2); whitened by the noises (sigma_g C, sigma_b)
    # that is a shift of norm sqrt(sigma_g^-2 + (2 sigma_b)^-2): the Gaussian mechanism at 1 / that.
    C = 0.37
    whitened = math.hypot(C / (sigma_g * C), 0.5 / sigma_b)
    assert whitened == pytest.approx(1.0 / sigma, rel=1e-12)
    assert sigma_g > sigma and sigma_b == pytest.approx(count_noise * divisor)


def test_a_count_noise_that_leaves_the_gradient_nothing_is_refused():
    a = adaptive_lib.AdaptiveClipping(count_noise=0.05)
    with pytest.raises(PrivacyError, match=r"raise privacy\.adaptive\.count_noise above 0\.25"):
        a.gradient_noise_multiplier(1.0, 2.0)  # 2 sigma_b = 0.2 <= sigma = 1
    for bad in ({"quantile": 1.0}, {"learning_rate": 0}, {"count_noise": -1}, {"quantile": "x"}, {"typo": 1}):
        with pytest.raises(PrivacyError, match="privacy.adaptive"):
            adaptive_lib.AdaptiveClipping.from_record(bad)


def test_the_geometric_update():
    a = adaptive_lib.AdaptiveClipping(quantile=0.5, learning_rate=0.2)
    assert a.next_clip_norm(2.0, 0.5) == 2.0
    assert a.next_clip_norm(2.0, 1.0) == pytest.approx(2.0 * math.exp(-0.1))  # all unclipped: C shrinks
    assert a.next_clip_norm(2.0, 0.0) == pytest.approx(2.0 * math.exp(0.1))   # all clipped: C grows
    assert a.noisy_fraction(-2.0, 4.0) == 0.0 and a.noisy_fraction(2.0, 4.0) == 1.0


def test_the_plan_records_the_settings_and_the_fixed_clipping_event():
    pool = train_pool(30, seed=1)
    flat = plan_for(pool, "uls", expected=4.0, steps=6, sigma=0.9, clip=0.05)
    plan = adaptive_plan(pool, "uls")
    assert plan.dp_event == flat.dp_event and plan.adaptive == adaptive_lib.AdaptiveClipping(**SETTINGS)
    again = RunSpec.from_record(plan.to_record(), "plan.json")
    assert again == plan and "adaptive_clipping" not in flat.to_record()  # other plans are as they were
    with pytest.raises(DataError, match="plan.json: clipping is 'adaptive' with adaptive_clipping absent"):
        RunSpec.from_record({**plan.to_record(), "adaptive_clipping": None}, "plan.json")
    with pytest.raises(DataError, match="plan.json: privacy.adaptive.quantile is 2"):
        RunSpec.from_record({**plan.to_record(), "adaptive_clipping": {**SETTINGS, "quantile": 2}}, "plan.json")


def test_plan_cell_calibrates_as_fixed_clipping_and_refuses_a_count_without_budget():
    from userdp.privacy.planner import plan_cell

    counts = np.array([3, 5, 8, 2, 9, 4, 6, 7] * 25)
    common = dict(dataset="d", method="uls", epsilon=4.0, compute_budget=2000, steps=20, counts=counts)
    flat = plan_cell(**common, privacy={"clip_norm": 1.0, "clipping": "flat", "group_size": {"uls": 4}})
    plan = plan_cell(**common, privacy={"clip_norm": 1.0, "clipping": "adaptive", "group_size": {"uls": 4},
                                        "adaptive": {"count_noise": 0.1}})
    assert plan.noise_multiplier == flat.noise_multiplier and plan.dp_event == flat.dp_event
    assert plan.adaptive_clipping == {"quantile": 0.5, "learning_rate": 0.2, "count_noise": 0.1}
    with pytest.raises(PrivacyError, match=r"method=uls eps=4.*raise privacy\.adaptive\.count_noise above"):
        plan_cell(**common, privacy={"clip_norm": 1.0, "clipping": "adaptive", "group_size": {"uls": 4},
                                     "adaptive": {"count_noise": 0.001}})


# ---------------------------------------------------------------- the engine against a slow loop


def _unit_norm(model, pool, rows, weights) -> float:
    """||sum_r w_r grad(mean-token CE of row r)||, one backward per row (float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    acc = [torch.zeros_like(p) for p in params]
    for r, w in zip(rows, weights):
        ids = torch.as_tensor(np.asarray(pool.tokens(int(r))[:SEQ], dtype=np.int64))[None]
        loss = model(input_ids=ids, labels=ids).loss
        for a, g in zip(acc, torch.autograd.grad(loss * w, params)):
            a.add_(g)
    return float(torch.sqrt(sum((a ** 2).sum() for a in acc)))


def _units(pool, sel, method) -> list[tuple[list[int], list[float]]]:
    """The sampled units of a step: rows and their weights (ELS one row, weight 1; ULS a user's rows, 1 / m_u)."""
    rows = [int(r) for r in sel.rows]
    if method == "els":
        return [([r], [1.0]) for r in rows]
    users: dict[int, list[int]] = {}
    for r in rows:
        users.setdefault(int(pool.example_user[r]), []).append(r)
    return [(rs, [1.0 / len(rs)] * len(rs)) for rs in users.values()]


@pytest.mark.parametrize("method", ["els", "uls"])
def test_the_engine_follows_the_slow_loop(method, tmp_path):
    pool = train_pool(24, seed=3)
    plan = adaptive_plan(pool, method)
    settings = TrainSettings(learning_rate=0.0, optimizer="sgd", schedule="constant", warmup_steps=0,
                             physical_batch_size=8, sequence_length=SEQ, checkpoint_every=1000, device="cpu",
                             log_every_s=1e9)
    seeds = run_seeds.run_seeds(0, 0, "tiny", method, "8", 12, 3, 1e-2, secret=False)
    seen: list[step.StepObservation] = []
    model = tiny_model(seed=1).double()
    out = engine.train(model, pool, plan, settings, run_state.RunPaths(tmp_path / "run"), seeds, 0,
                       compute_epsilon=pld_epsilon, observe=seen.append)
    assert out.complete and len(seen) == plan.steps

    a = plan.adaptive
    m = plan.expected_batch  # q N = 4 on this pool
    sigma_g = a.gradient_noise_multiplier(plan.noise_multiplier, m)
    gen = torch.Generator().manual_seed(int(seeds["noise"]))
    params = [p for p in model.parameters() if p.requires_grad]
    C, clips, fractions, moved = float(plan.clip_norm), [], [], 0
    for o in seen:
        assert o.clip_norm == pytest.approx(C, rel=1e-12)
        for p, noise in zip(params, o.noise):  # the gradient's noise: sigma_g C_t times the run's own draws
            draw = torch.randn(p.shape, generator=gen, dtype=torch.float32).double()
            torch.testing.assert_close(noise, draw * (sigma_g * C), rtol=1e-12, atol=0)
        count_draw = float(torch.randn((), generator=gen, dtype=torch.float64))
        norms = [_unit_norm(model, pool, rows, w) for rows, w in _units(pool, o.selection, method)]
        assert all(abs(n - C) > 1e-9 * C for n in norms)  # no tie: the comparison is robust
        s = sum(n <= C for n in norms) - 0.5 * len(norms) + count_draw * a.count_noise * m
        assert o.released_count == pytest.approx(s, rel=1e-12, abs=1e-12)
        clips.append(C)
        fractions.append(s / m + 0.5)
        C_next = C * math.exp(-a.learning_rate * (s / m + 0.5 - a.quantile))
        moved += C_next != C
        C = C_next
    assert moved == plan.steps and max(clips) / min(clips) > 1.2  # it moves, and by more than rounding

    log = pd.read_parquet(tmp_path / "run" / "train_log.parquet")
    assert list(log.columns) == ["step", "learning_rate", "update_norm", "update_signal_norm", "clip_norm",
                                 "unclipped_fraction_noisy"]
    np.testing.assert_allclose(log["clip_norm"], clips, rtol=1e-12)
    np.testing.assert_allclose(log["unclipped_fraction_noisy"], fractions, rtol=1e-12, atol=1e-12)
    led = out.ledger
    assert led["clipping"] == "adaptive" and led["noise_multiplier"] == plan.noise_multiplier
    assert led["adaptive_clipping"] == pytest.approx({**SETTINGS, "gradient_noise_multiplier": sigma_g,
                                                      "count_noise_std": a.count_noise * m, "clip_norm_final": C})
    # the ledger's epsilon is its event's, re-accounted, and the event is fixed clipping's at the plan's sigma
    assert led["dp_event"] == plan.dp_event
    assert ledger_lib.guarantee_epsilon([ledger_lib.run_event(led)], led["delta"], accountant=pld_epsilon) \
        == led["epsilon"] == pytest.approx(pld_epsilon(plan.event, plan.delta), rel=1e-12)
    card = (tmp_path / "run" / "README.md").read_text()
    assert "adaptive clipping" in card and "the gradient's own multiplier" in card


def test_a_resumed_run_with_adam_bc_equals_one_run_straight_through(tmp_path):
    pool = train_pool(30, seed=1)
    plan = adaptive_plan(pool, "els", steps=5, clip=0.05)
    seeds = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 12, 3, 1e-2, secret=False)
    settings = run_settings(optimizer="adam_bc", checkpoint_every=2)
    outs = []
    for name, stops in (("straight", [None]), ("resumed", [3, None])):
        paths = run_state.RunPaths(tmp_path / name)
        for max_steps in stops:
            out = engine.train(tiny_model(seed=2), pool, plan, settings, paths, seeds, 0,
                               compute_epsilon=pld_epsilon, max_steps=max_steps)
        outs.append((out, pd.read_parquet(paths.train_log)))
    (a, log_a), (b, log_b) = outs
    assert b.ledger["resumed_at_steps"] == [3] and a.ledger["resumed_at_steps"] == []
    pd.testing.assert_frame_equal(log_a, log_b)
    assert a.ledger["adaptive_clipping"] == b.ledger["adaptive_clipping"]
    assert log_a["clip_norm"].nunique() == plan.steps


def test_make_private_runs_adaptive_clipping_from_privacy_arguments(tmp_path):
    import userdp
    from test_api import checkpoint, users_frame
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    privacy = userdp.PrivacyArguments(method="uls", epsilon=8.0, compute=300, user_column="author",
                                      text_column="body", secret_seeds=False, clipping="adaptive",
                                      adaptive={"count_noise": 0.5, "quantile": 0.9})
    dp = userdp.make_private(model, torch.optim.SGD(model.parameters(), lr=1e-3), data=users_frame(),
                             tokenizer=AutoTokenizer.from_pretrained(ckpt), privacy=privacy, steps=3)
    assert dp.spec.adaptive == adaptive_lib.AdaptiveClipping(quantile=0.9, count_noise=0.5)
    rows = [dp.step() for _ in range(3)]
    clips = [r.clip_norm for r in rows]
    assert clips[0] == dp.spec.clip_norm and len(set(clips)) == 3
    with pytest.raises(Exception, match=r"privacy\.adaptive|adaptive"):
        userdp.PrivacyArguments(method="uls", epsilon=8.0, compute=300, clipping="adaptive",
                                adaptive={"quantile": 1.5})


def test_privacy_adaptive_changes_the_plans_only_under_adaptive_clipping():
    """Rule plan's `privacy` param: privacy.adaptive is in it only with clipping adaptive (and private cells), so
    existing plans stay up to date when the key is added or changed under flat clipping."""
    from userdp.config import validate_config
    from userdp.privacy.targets import plan_privacy_params

    def params(privacy, eps="1"):
        cfg = validate_config({"datasets": {"synth": {"source": "synthetic"}}, "privacy": privacy})
        return plan_privacy_params(cfg, "uls", eps)

    flat = params({})
    assert "adaptive" not in flat and flat == params({"adaptive": {"quantile": 0.9}})
    on = params({"clipping": "adaptive", "adaptive": {"quantile": 0.9}})
    assert on["adaptive"] == {"quantile": 0.9, "learning_rate": 0.2, "count_noise": 0.05}  # schema defaults
    assert "adaptive" not in params({"clipping": "adaptive"}, eps="inf")


def test_a_checkpoint_of_other_adaptive_settings_is_not_resumed(tmp_path):
    """The checkpoint key (run_state.fingerprint_plan, also UserDPTrainer's) covers adaptive clipping's settings: a
    run stopped under one count_noise starts afresh under another, rather than continue its noise and clip norm."""
    pool = train_pool(30, seed=1)
    seeds = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 12, 3, 1e-2, secret=False)
    paths = run_state.RunPaths(tmp_path / "run")
    first = adaptive_plan(pool, "els", steps=4)
    other = first.replace(adaptive_clipping={**SETTINGS, "count_noise": 0.3})
    assert run_state.fingerprint_plan(first) != run_state.fingerprint_plan(other)
    assert "adaptive_clipping" not in run_state.fingerprint_plan(plan_for(pool, "els", expected=4.0, steps=4))
    engine.train(tiny_model(seed=2), pool, first, run_settings(), paths, seeds, 0, compute_epsilon=pld_epsilon,
                 max_steps=2)
    out = engine.train(tiny_model(seed=2), pool, other, run_settings(), paths, seeds, 0, compute_epsilon=pld_epsilon)
    assert out.complete and out.ledger["resumed_at_steps"] == []
    assert out.ledger["adaptive_clipping"]["count_noise"] == 0.3


def test_a_gradient_source_without_a_clip_norm_and_a_fixed_adam_bc_noise_are_refused():
    from train_fixtures import ConstantGradients
    from userdp.errors import ConfigError
    from userdp.training.optim import AdamBC

    pool = train_pool(30, seed=1)
    plan = adaptive_plan(pool, "els")
    seeds = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 12, 3, 1e-2, secret=False)

    class NoClipNorm:
        def __init__(self, model, clip_norm, normalize=False):
            self.inner = ConstantGradients(model, clip_norm)

        def accumulate(self, *a, **k):
            return self.inner.accumulate(*a, **k)

    with pytest.raises(ConfigError, match="NoClipNorm has no clip_norm attribute"):
        engine.setup(tiny_model(), pool, plan, run_settings(), None, seeds, 0, gradient_source=NoClipNorm)
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"AdamBC\.noise_std is 0\.5"):
        engine.setup(model, pool, plan, run_settings(), None, seeds, 0,
                     optimizer=AdamBC(model.parameters(), lr=1e-3, noise_std=0.5))
