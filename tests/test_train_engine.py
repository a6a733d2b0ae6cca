"""The DP-SGD loop: expected-size division, noise, resume, ledger (invariants 10.2, 10.5, 10.6)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest
import torch
from scipy import stats

from train_fixtures import VOCAB, ConstantGradients, LoopGradients, plan_for, run_settings, tiny_model, tokens_table
from userdp.errors import ConfigError, DataError, Preempted, run_main
from userdp.io import read_json
from userdp.training import engine, run_seeds, run_state, step_log
from userdp.training.noise import GaussianNoise
from userdp.training.optim import LRMultiplier
from userdp.training.pool import build_pool


def fake_epsilon(event, delta):
    """A fast stand-in for the accountant ((event, delta) -> epsilon) where epsilon's value is not under test."""
    return 1.0 + event.count * 1e-3 if hasattr(event, "count") else 1.0


@pytest.fixture(scope="module")
def pool():
    from train_fixtures import train_pool

    return train_pool(40, 3)


settings = run_settings


def seeds(method="els"):
    return run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, 3)


def params_vector(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


@pytest.mark.parametrize("method", ["els", "uls"])
@pytest.mark.parametrize("private", [True, False])
def test_update_divides_by_expected_not_realised_size(tmp_path, pool, method, private):
    model = tiny_model()
    before = params_vector(model)
    expected = 7.3  # not an integer: the realised count can never equal it
    plan = plan_for(pool, method, expected=expected, steps=1, sigma=0.0, clip=1.0 if private else None)
    out = engine.train(model, pool, plan, settings(optimizer="sgd", learning_rate=1.0), run_state.RunPaths(tmp_path),
                       seeds(method), 0, gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)
    realised = int(out.log["realised_units"].iloc[0])
    assert realised > 0 and realised != expected
    delta = params_vector(model) - before
    # every unit adds 1 to every coordinate: SGD(lr=1) moves by -(realised / expected)
    assert torch.allclose(delta, torch.full_like(delta, -realised / expected), atol=1e-6)
    assert out.ledger["expected_batch"] == pytest.approx(expected)
    if not private:
        assert out.ledger["epsilon"] == math.inf and out.ledger["clip_norm"] is None


def test_noise_std_and_fresh_every_step(tmp_path, pool):
    model = tiny_model()
    sigma, C, E = 2.0, 0.5, 4.0
    plan = plan_for(pool, "els", expected=E, steps=2, sigma=sigma, clip=C)
    deltas = []
    prev = params_vector(model)

    def record(step, row):
        nonlocal prev
        now = params_vector(model)
        deltas.append((now - prev) * E)  # SGD lr=1 and zero gradients: delta = -noise / E
        prev = now

    # physical batch 1: many micro-batches per step, yet noise is added once per step
    engine.train(model, pool, plan, settings(optimizer="sgd", learning_rate=1.0, physical_batch_size=1),
                 run_state.RunPaths(tmp_path), seeds(), 0,
                 gradient_source=lambda m, c, normalize=False: ConstantGradients(m, c, value=0.0),
                 compute_epsilon=fake_epsilon, on_step=record)
    n = deltas[0].numel()
    assert n > 3000
    for d in deltas:
        assert abs(float(d.std()) / (sigma * C) - 1) < 5 / math.sqrt(2 * n)
        assert abs(float(d.mean())) < 5 * sigma * C / math.sqrt(n)
        assert stats.kstest(d.numpy() / (sigma * C), "norm").pvalue > 1e-3
    # fresh noise: the two steps' draws are uncorrelated
    corr = float(np.corrcoef(deltas[0].numpy(), deltas[1].numpy())[0, 1])
    assert abs(corr) < 5 / math.sqrt(n)


def test_noise_generator_state_roundtrip():
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = torch.zeros(1000)
    a = GaussianNoise(1.0, 1.0, seed=5)
    a.add_([p])
    state = a.state_dict()
    p.grad.zero_()
    a.add_([p])
    first = p.grad.clone()
    b = GaussianNoise(1.0, 1.0, seed=123)
    b.load_state_dict(state)
    p.grad.zero_()
    b.add_([p])
    assert torch.equal(first, p.grad)
    assert GaussianNoise(0.0, None, seed=0).std == 0.0


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("method,source", [("els", None), ("uls", None), ("uls", LoopGradients)])
def test_resume_reproduces_uninterrupted_run(tmp_path, pool, method, source):
    """Stopped-and-resumed and crashed-and-resumed runs end bitwise equal to an uninterrupted one.

    source None = the engine's default, the real ClippedGradients.
    """
    T = 6
    plan = plan_for(pool, method, expected=2.5, steps=T, sigma=0.7, clip=0.5)
    s = settings(optimizer="adam", schedule="cosine", warmup_steps=2, physical_batch_size=4)

    def run(path, **kw):
        model = tiny_model(seed=1)
        out = engine.train(model, pool, plan, s, run_state.RunPaths(path), seeds(method), 0,
                           gradient_source=source, compute_epsilon=fake_epsilon, **kw)
        return model, out

    ref_model, ref = run(tmp_path / "ref")
    assert ref.complete and len(ref.log) == T

    # (a) stop cleanly after 3 steps, then resume
    steps_run = []
    m1, out1 = run(tmp_path / "a", max_steps=3, on_step=lambda st, r: steps_run.append(st))
    assert not out1.complete and out1.steps_completed == 3
    assert (tmp_path / "a" / "checkpoint" / "state.pt").exists()
    assert not (tmp_path / "a" / "ledger.json").exists()
    m2, out2 = run(tmp_path / "a", on_step=lambda st, r: steps_run.append(st))
    assert steps_run == list(range(1, T + 1))  # never more than T noisy steps in total
    assert torch.equal(params_vector(m2), params_vector(ref_model))

    # (b) crash inside step 5 (after the step-4 checkpoint); the rerun redoes step 5 from the checkpoint
    def crash(st, r):
        if st == 5:
            raise Crash()

    with pytest.raises(Crash):
        run(tmp_path / "b", on_step=crash)
    m3, out3 = run(tmp_path / "b")
    assert torch.equal(params_vector(m3), params_vector(ref_model))

    for path, out in ((tmp_path / "a", out2), (tmp_path / "b", out3)):
        ledger = read_json(path / "ledger.json")
        assert ledger["steps_completed"] == T and ledger["complete"]
        assert ledger["examples_processed"] == read_json(tmp_path / "ref" / "ledger.json")["examples_processed"]
        log = pd.read_parquet(path / "train_log.parquet")
        assert log["step"].tolist() == list(range(1, T + 1))
        # on disk: the guaranteed columns only (training.debug_step_log off), equal to the uninterrupted run's
        assert list(log.columns) == step_log.GUARANTEED_COLUMNS
        pd.testing.assert_frame_equal(log, pd.read_parquet(tmp_path / "ref" / "train_log.parquet"))
        # in memory (and in the checkpoint) every column, resumed rows included
        cols = ["step", "loss", "realised_examples", "realised_users", "examples_processed", "learning_rate",
                "update_norm", "update_signal_norm"]
        pd.testing.assert_frame_equal(out.log[cols], ref.log[cols])
        assert not (path / "checkpoint").exists()  # removed once the outputs are written
        assert (path / "model" / "model.safetensors").exists()
    assert read_json(tmp_path / "a" / "ledger.json")["resumed_at_steps"] == [3]
    assert read_json(tmp_path / "b" / "ledger.json")["resumed_at_steps"] == [4]


def test_checkpoint_of_another_mechanism_is_ignored(tmp_path, pool):
    plan = plan_for(pool, "els", expected=3.0, steps=4, sigma=0.7, clip=0.5)
    engine.train(tiny_model(), pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                 gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, max_steps=2)
    other = plan.replace(noise_multiplier=0.9)
    steps_run = []
    out = engine.train(tiny_model(), pool, other, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon,
                       on_step=lambda st, r: steps_run.append(st))
    assert steps_run == [1, 2, 3, 4] and out.ledger["resumed_at_steps"] == []


def test_checkpoint_of_another_base_model_or_pool_is_ignored(tmp_path, pool):
    """A rebuilt pretrained model or rebuilt training data must not resume an old run's checkpoint."""
    plan = plan_for(pool, "els", expected=3.0, steps=4, sigma=0.7, clip=0.5)
    engine.train(tiny_model(seed=1), pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                 gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, max_steps=2)
    out = engine.train(tiny_model(seed=2), pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, max_steps=2)
    assert out.steps_completed == 2  # started afresh with model 2, stopped again at step 2
    # same sizes, other tokens (a rebuilt tokens.parquet): not resumed either
    other_pool = dataclasses.replace(pool, token_values=(pool.token_values + 1) % VOCAB)
    steps_run = []
    out = engine.train(tiny_model(seed=2), other_pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon,
                       on_step=lambda st, r: steps_run.append(st))
    assert steps_run == [1, 2, 3, 4] and out.ledger["resumed_at_steps"] == []
    # and the same model and pool do resume
    engine.train(tiny_model(seed=2), pool, plan, settings(), run_state.RunPaths(tmp_path / "r"), seeds(), 0,
                 gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, max_steps=2)
    out = engine.train(tiny_model(seed=2), pool, plan, settings(), run_state.RunPaths(tmp_path / "r"), seeds(), 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)
    assert out.ledger["resumed_at_steps"] == [2]


def test_checkpoint_of_another_device_is_ignored(tmp_path, pool):
    """A checkpoint holds its device's noise-generator state: a run on another device starts afresh."""
    from userdp.training import checkpoint as ckpt
    from userdp.training.models import resolve_device

    plan = plan_for(pool, "els", expected=3.0, steps=4, sigma=0.7, clip=0.5)
    engine.train(tiny_model(), pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                 gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, max_steps=2)
    fp = {dev: run_state.run_fingerprint(plan, settings(device=dev), torch.device(dev), seeds(), pool, tiny_model(),
                                      pool.n_examples) for dev in ("cpu", "cuda")}
    assert fp["cpu"] != fp["cuda"]
    assert ckpt.load_checkpoint(tmp_path / "checkpoint", fp["cpu"]) is not None
    assert ckpt.load_checkpoint(tmp_path / "checkpoint", fp["cuda"]) is None
    # the device the run resolves counts, not the setting's text: auto on a CPU-only machine resumes
    out = engine.train(tiny_model(), pool, plan, settings(device="auto"), run_state.RunPaths(tmp_path), seeds(), 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)
    assert out.ledger["resumed_at_steps"] == ([2] if resolve_device("auto").type == "cpu" else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_checkpoint_does_not_resume_on_cuda(tmp_path, pool):
    plan = plan_for(pool, "els", expected=3.0, steps=4, sigma=0.7, clip=0.5)
    engine.train(tiny_model(), pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                 gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, max_steps=2)
    out = engine.train(tiny_model(), pool, plan, settings(device="cuda"), run_state.RunPaths(tmp_path), seeds(), 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)
    assert out.ledger["resumed_at_steps"] == [] and out.ledger["device"].startswith("cuda")


def test_learning_rates_of_a_sweep_draw_independent_batches_and_noise():
    """Shared noise across the rates of a sweep would cancel between released models (audit finding)."""
    a = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3, 0.001)
    b = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3, 0.003)
    assert a["noise"] != b["noise"] and a["sampler"] != b["sampler"]
    assert a == run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3, 0.001)  # still reproducible


def test_secret_seeds_are_fresh_hidden_and_survive_resume(tmp_path, pool, monkeypatch):
    """privacy.secret_seeds: sampler and noise seeds from OS entropy, masked in the ledger, kept across a resume."""
    plan = plan_for(pool, "uls", expected=2.5, steps=4, sigma=0.7, clip=0.5)
    secret = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 100, 3, 0.01, secret=True)

    def run(path, **kw):
        model = tiny_model(seed=1)
        out = engine.train(model, pool, plan, settings(), run_state.RunPaths(path), secret, 0,
                           gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, **kw)
        return params_vector(model), out

    # two runs from the same config differ: the noise is not reproducible from the config
    p1, out1 = run(tmp_path / "a")
    p2, _ = run(tmp_path / "b")
    assert not torch.equal(p1, p2)
    assert out1.ledger["seeds"]["sampler"] == "secret" and out1.ledger["seeds"]["noise"] == "secret"
    assert str(secret["noise"]) not in (tmp_path / "a" / "ledger.json").read_text()

    # an interrupted run resumes the SAME secret streams from its checkpoint, not fresh ones
    draws = iter([11, 12, 11, 12, 99, 98])  # ref run, first half, resumed half (fresh entropy is ignored)
    monkeypatch.setattr(run_seeds.secrets, "randbits", lambda k: next(draws))
    ref, _ = run(tmp_path / "ref")
    run(tmp_path / "c", max_steps=2)
    resumed, out = run(tmp_path / "c")
    assert out.ledger["resumed_at_steps"] == [2]
    assert torch.equal(resumed, ref)


@pytest.mark.parametrize("method,G", [pytest.param("els", 2, marks=pytest.mark.integration), ("uls", 3)])
def test_ledger_epsilon_matches_plan(tmp_path, method, G):
    from privacy_helpers import epsilon_of

    t = tokens_table(40, seed=3)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    pool = build_pool(train, G, seed=0)
    T, sigma, delta = 3, 1.0, 1e-3
    plan = plan_for(pool, method, expected=2.0, steps=T, sigma=sigma, clip=1.0, delta=delta)
    plan = plan.replace(epsilon_achieved=epsilon_of(method, sigma, plan.sampling_rate, T, delta,
                                                    group_size=G if method == "els" else 1))
    out = engine.train(tiny_model(), pool, plan, settings(), run_state.RunPaths(tmp_path), seeds(method), 0,
                       gradient_source=ConstantGradients)
    ledger = read_json(tmp_path / "ledger.json")
    assert ledger["epsilon"] == pytest.approx(plan.epsilon_achieved, rel=1e-9)
    for key in ("method", "sampling_rate", "noise_multiplier", "clip_norm", "clipping", "group_size", "delta",
                "accountant"):
        assert ledger[key] == getattr(plan, key)
    assert ledger["steps_completed"] == ledger["steps_planned"] == T
    assert set(ledger["versions"]) >= {"torch", "transformers", "dp_accounting", "userdp", "python"}
    assert ledger["examples_processed"] == int(out.log["realised_examples"].sum())
    assert ledger["compute_ratio"] == pytest.approx(ledger["examples_processed"] / plan.compute_budget)
    assert ledger["seed"] == 0


@pytest.mark.parametrize("opt", ["adam", "sgd", "adafactor"])
def test_optimizers_step(tmp_path, pool, opt):
    model = tiny_model()
    before = params_vector(model)
    plan = plan_for(pool, "els", expected=3.0, steps=2, sigma=0.5, clip=1.0)
    out = engine.train(model, pool, plan, settings(optimizer=opt), run_state.RunPaths(tmp_path), seeds(), 0,
                       gradient_source=LoopGradients, compute_epsilon=fake_epsilon)
    assert out.complete and not torch.equal(before, params_vector(model))
    assert out.log["loss"].notna().any()


def test_schedules():
    warm = LRMultiplier("constant", 3, 10)
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    lin = LRMultiplier("linear", 0, 10)
    assert lin(0) == 1.0 and lin(5) == pytest.approx(0.5) and lin(9) == pytest.approx(0.1)
    cos = LRMultiplier("cosine", 0, 10)
    assert cos(0) == 1.0 and cos(5) == pytest.approx(0.5) and cos(9) < 0.05
    with pytest.raises(ConfigError, match="training.schedule"):
        LRMultiplier("step", 0, 10)


def test_learning_rate_log_follows_schedule(tmp_path, pool):
    plan = plan_for(pool, "els", expected=2.0, steps=4, sigma=0.5, clip=1.0)
    out = engine.train(tiny_model(), pool, plan, settings(schedule="linear", learning_rate=0.1),
                       run_state.RunPaths(tmp_path), seeds(), 0, gradient_source=ConstantGradients,
                       compute_epsilon=fake_epsilon)
    assert out.log["learning_rate"].tolist() == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_uls_with_too_small_physical_batch_fails_early(tmp_path, pool):
    plan = plan_for(pool, "uls", expected=2.0, steps=2)
    with pytest.raises(ConfigError, match=r"physical_batch_size is 2 .*\(G = 3 from the plan\)"):
        engine.train(tiny_model(), pool, plan, settings(physical_batch_size=2), run_state.RunPaths(tmp_path), seeds(),
                     0, gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)
    bad = plan.replace(group_size=5)
    with pytest.raises(DataError, match="group_size"):
        engine.train(tiny_model(), pool, bad, settings(), run_state.RunPaths(tmp_path), seeds(), 0,
                     gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)


def test_sigterm_saves_a_checkpoint_after_the_step_and_the_resumed_run_is_identical(tmp_path, pool):
    """SIGTERM (SLURM's preemption signal) mid-run: the step in progress finishes, the checkpoint is written
    although no periodic one is due, the job exits with 143, and the resubmitted run ends bitwise equal to an
    uninterrupted one. The previous SIGTERM handler is back afterwards."""
    import os
    import signal

    T = 6
    plan = plan_for(pool, "els", expected=2.5, steps=T, sigma=0.7, clip=0.5)
    s = settings(optimizer="adam", checkpoint_every=100, physical_batch_size=4)

    def run(path, **kw):
        model = tiny_model(seed=1)
        out = engine.train(model, pool, plan, s, run_state.RunPaths(path), seeds(), 0, compute_epsilon=fake_epsilon,
                           **kw)
        return model, out

    ref_model, _ = run(tmp_path / "ref")
    previous = signal.getsignal(signal.SIGTERM)
    seen = []

    def term_at_3(step, row):
        seen.append(step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered to this process

    with pytest.raises(Preempted):  # the library stops; the job decides the exit code
        run(tmp_path / "a", on_step=term_at_3)
    assert seen == [1, 2, 3]  # stopped after the step in progress
    assert (tmp_path / "a" / "checkpoint" / "state.pt").exists()  # only the SIGTERM path could have written it
    assert not (tmp_path / "a" / "ledger.json").exists()
    assert signal.getsignal(signal.SIGTERM) is previous
    resumed = []
    m2, out2 = run(tmp_path / "a", on_step=lambda st, r: resumed.append(st))
    assert resumed == [4, 5, 6] and out2.complete
    try:  # under the job's entry (run_main's own SIGTERM handler): the step finishes, the checkpoint is saved
        # and the job exits 128 + SIGTERM (what SLURM and snakemake read as stopped). Before, run_main's handler
        # was chained and stopped the step at once, so no checkpoint was saved.
        with pytest.raises(SystemExit) as exc:
            run_main(lambda: run(tmp_path / "b", on_step=lambda st, r: st == 2 and os.kill(os.getpid(),
                                                                                        signal.SIGTERM)))
        assert exc.value.code == 128 + signal.SIGTERM
        assert (tmp_path / "b" / "checkpoint" / "state.pt").exists()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert torch.equal(params_vector(m2), params_vector(ref_model))
