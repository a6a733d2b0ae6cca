"""Containment of non-finite gradients (docs/method.md section 3, "Containment").

A unit (example for ELS, user for ULS) whose gradient is not finite must
contribute exactly zero, and a zero-norm unit under normalized clipping must
contribute zero instead of C * 0 / 0: otherwise one user's data turns the
released model into NaN whenever that user is sampled, which the noise does
not cover. The crafted inputs poison one unit inside a real model (a NaN in
its forward, or an inf in its backward), in float32 and under bf16 autocast;
the clipped sum must equal the brute-force sum over the other units and
nothing may be NaN.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from clipping_fixtures import VOCAB, batch, clipped_sum, fresh, per_unit_grads, tiny_gpt2, tiny_llama
from userdp.training.clipping import ClippedGradients, norm_floor

torch.set_num_threads(1)

MAGIC = VOCAB - 1  # the poisoned unit's rows carry this token; no other row does
BAD_ROW = 2        # ELS: unit 2; ULS: row 2 belongs to user 3 (rows 0 and 2), so the whole user is dropped
MAKERS = {"gpt2-tied": lambda dt: tiny_gpt2(True, dtype=dt), "llama-untied": lambda dt: tiny_llama(False, dtype=dt)}


def _batch(level: str, dtype: torch.dtype):
    ids, mask, units, w = batch(level, dtype=dtype)
    ids = ids.masked_fill(ids == MAGIC, 5)
    ids[BAD_ROW, 2] = MAGIC
    return ids, mask, units, w


def _blocks(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def poison(model, kind: str) -> list:
    """Hooks that make the gradient of the rows holding MAGIC non-finite; returns the handles.

    nan-forward: the rows' input embeddings become NaN (everything downstream, loss included, is NaN).
    inf-backward: the forward is untouched (finite loss) but the output gradient of the first block's
    MLP gets +inf at one token of those rows, so every layer upstream sees inf/NaN.
    """
    state = {}

    def embed_hook(module, args, output):
        state["bad"] = (args[0] == MAGIC).any(1)
        if kind == "nan-forward":
            return torch.where(state["bad"][:, None, None], torch.full_like(output, math.nan), output)
        return None

    def mlp_hook(module, args, output):
        bad = state["bad"]

        def grad_hook(g):
            spike = torch.zeros_like(g)
            spike[:, 1] = math.inf
            return torch.where(bad[:, None, None], g + spike, g)

        output.register_hook(grad_hook)

    handles = [model.get_input_embeddings().register_forward_hook(embed_hook)]
    if kind == "inf-backward":
        handles.append(_blocks(model)[0].mlp.register_forward_hook(mlp_hook))
    return handles


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.requires_grad]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float) -> None:
    assert all(torch.isfinite(g).all() for g in got)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    err = max(float((g.double() - w.double()).abs().max()) for g, w in zip(got, want))
    assert err <= rtol * scale, f"max abs error {err:.3e} vs scale {scale:.3e}"


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return MAKERS[name](torch.float32)


@functools.lru_cache(maxsize=None)
def _reference(name: str, level: str):
    """Brute-force per-unit gradients of the clean model (one backward per unit)."""
    return per_unit_grads(fresh(_model(name)), *_batch(level, torch.float32))


def _poisoned_sum(name, level, kind, method, clip, normalize, bf16):
    model = fresh(_model(name))
    handles = poison(model, kind)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            stats = ClippedGradients(model, clip, normalize=normalize, norm_method=method).accumulate(
                *_batch(level, torch.float32))
    finally:
        for h in handles:
            h.remove()
    return stats, _grads(model)


def _rel_l2(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g.double() - v.double()).square().sum()) for g, v in zip(got, want))
    return (num / sum(float(v.double().square().sum()) for v in want)) ** 0.5


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("level", ["els", "uls"])
@pytest.mark.parametrize("kind", ["nan-forward", "inf-backward"])
def test_nonfinite_unit_contributes_zero(name, level, kind):
    """Flat clipping without effect (the old NaN norm -> factor 1 -> NaN added unclipped) and
    normalized clipping, both norm formulas; float32 against the brute force over the other units,
    bf16 autocast against it at bf16 accuracy and against the same computation without the unit."""
    ids, mask, units, w = _batch(level, torch.float32)
    bad_unit = int(units[BAD_ROW])
    n_bad_rows = int((units == bad_unit).sum())
    others = {u: g for u, g in _reference(name, level).items() if u != bad_unit}
    cases = [(m, c, nz, False) for m in ("ghost", "instantiate") for c, nz in ((1e4, False), (0.3, True))]
    cases += [(m, 0.3, True, True) for m in ("ghost", "instantiate")]
    for method, clip, normalize, bf16 in cases:
        stats, got = _poisoned_sum(name, level, kind, method, clip, normalize, bf16)
        order = stats.unit_ids.tolist()
        norms = stats.unit_norms
        assert not math.isfinite(float(norms[order.index(bad_unit)]))  # the hooks did poison the unit
        assert torch.isfinite(norms[[u != bad_unit for u in order]]).all()
        assert stats.nonfinite_units == 1
        # the dropped unit's rows are left out of the loss statistics
        assert stats.n_rows == int((units >= 0).sum()) - n_bad_rows and math.isfinite(stats.loss_sum)
        want, _ = clipped_sum(others, clip, normalize)
        if not bf16:
            _assert_close(got, want, rtol=1e-4)
            continue
        assert all(torch.isfinite(g).all() for g in got)
        assert _rel_l2(got, want) <= 5e-2
        absent = fresh(_model(name))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ClippedGradients(absent, clip, normalize=normalize, norm_method=method).accumulate(
                ids, mask, units.masked_fill(units == bad_unit, -1), w)
        _assert_close(got, _grads(absent), rtol=1e-3)


def test_one_token_example_under_normalized_clipping():
    """A 1-token example has no target, so its gradient is exactly zero: normalized clipping
    used to compute C * 0 / tiny = 0 * inf = NaN for C > 4 in float32 (28,832 of this model's
    30,624 coordinates at C = 5 or 100); it must contribute zero, for any C."""
    model = _model("gpt2-tied")
    ids, mask, units, w = batch("els", dtype=torch.float32)
    units, w = units.clone(), w.clone()
    units[3], w[3] = 3, 1.0  # row 3 (one token) becomes a real unit instead of padding
    ref = per_unit_grads(fresh(model), ids, mask, units, w)
    assert all(float(g.abs().max()) == 0.0 for g in ref[3])  # its gradient really is zero
    for clip in (1.0, 5.0, 100.0, 1e6):
        want, _ = clipped_sum({u: g for u, g in ref.items() if u != 3}, clip, True)
        for method in ("ghost", "instantiate"):
            for bf16 in (False, True):
                m = fresh(model)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    stats = ClippedGradients(m, clip, normalize=True, norm_method=method).accumulate(
                        ids, mask, units, w)
                assert stats.nonfinite_units == 0 and float(stats.unit_norms[3]) == 0.0
                got = _grads(m)
                if bf16:
                    assert all(torch.isfinite(g).all() for g in got) and _rel_l2(got, want) <= 5e-2
                else:
                    _assert_close(got, want, rtol=1e-4)


def test_clip_factors_on_crafted_norms():
    """Factor per norm: NaN/inf -> 0 (dropped) in both modes; normalized: 0 at or below the
    underflow floor and where C / norm overflows; flat: min(1, C / norm)."""
    model = tiny_gpt2(True, dtype=torch.float32)
    floor = norm_floor([p for p in model.parameters()])
    assert 0 < floor < 1e-10
    norms = torch.tensor([math.nan, math.inf, 0.0, floor / 2, 4 * floor, 0.5, 3.0], dtype=torch.float32)
    flat = ClippedGradients(model, 1.0)
    f, dropped = flat._clip_factors(norms)
    assert dropped.tolist() == [True, True, False, False, False, False, False]
    np.testing.assert_allclose(f.tolist(), [0, 0, 1, 1, 1, 1, 1 / 3], rtol=1e-6)
    norm = ClippedGradients(model, 1.0, normalize=True)
    f, dropped = norm._clip_factors(norms)
    assert dropped.tolist() == [True, True, False, False, False, False, False]
    np.testing.assert_allclose(f.tolist(), [0, 0, 0, 0, 1 / (4 * floor), 2, 1 / 3], rtol=1e-6)
    # C / norm overflows float32 for a huge C: factor 0, never inf
    f, _ = ClippedGradients(model, 1e30, normalize=True)._clip_factors(torch.tensor([1e-9, 1.0]))
    assert f.tolist() == [0.0, pytest.approx(1e30, rel=1e-6)]


@pytest.mark.parametrize("method", ["els", "uls"])
def test_engine_counts_dropped_units_and_stays_finite(tmp_path, method):
    """Through the real engine: every step drops exactly the poisoned user's sampled units, counts them in
    the train log and the ledger (`nonfinite_units`, with training.debug_step_log: a noise-free count, outside
    the guarantee, so null by default), and the released parameters stay finite."""
    import pyarrow as pa

    import train_fixtures
    from userdp.training import engine, run_seeds, run_state
    from userdp.training.pool import build_pool
    from userdp.training.settings import TrainSettings

    t = train_fixtures.tokens_table(30, seed=4)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    magic, users = train_fixtures.VOCAB - 1, train["user_id"].to_pylist()
    poisoned = users[0]
    rows = [[5 if x == magic else x for x in r] for r in train["input_ids"].to_pylist()]
    rows = [r[:1] + [magic] + r[2:] if u == poisoned else r for u, r in zip(users, rows)]
    train = train.set_column(2, "input_ids", pa.array(rows, train.schema.field("input_ids").type))
    pool = build_pool(train, 3, seed=0)
    n = pool.n_examples if method == "els" else pool.n_users
    plan = train_fixtures.plan_for(pool, method, expected=0.5 * n, steps=6, sigma=0.5, clip=1.0)
    for debug in (True, False):
        model = train_fixtures.tiny_model(seed=1)
        model.get_input_embeddings().register_forward_hook(
            lambda mod, args, out: torch.where((args[0] == magic).any(1)[:, None, None], math.nan, out))
        s = TrainSettings(learning_rate=1e-2, physical_batch_size=4, sequence_length=train_fixtures.SEQ,
                          checkpoint_every=100, device="cpu", log_every_s=1e9, debug_step_log=debug)
        dropped, expected = [], []  # units dropped per step; the poisoned user's units sampled per step

        def observe(o):
            dropped.append(o.nonfinite_units)
            mine = int((pool.example_user[o.selection.rows] == pool.user_ids.index(poisoned)).sum())
            expected.append(mine if method == "els" else min(mine, 1))

        out = engine.train(model, pool, plan, s, run_state.RunPaths(tmp_path / f"{method}-{debug}"),
                           run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, 3), 0, compute_epsilon=lambda e, d: 1.0,
                           observe=observe)
        assert out.complete and all(torch.isfinite(p).all() for p in model.parameters())
        assert dropped == expected
        assert 0 < sum(dropped) and 0 in dropped  # steps with and without the poisoned user
        if debug:
            assert out.log["nonfinite_units"].tolist() == dropped
            assert out.ledger["nonfinite_units"] == sum(dropped)
            assert np.isfinite(out.log["loss"]).all()  # the dropped rows are left out of the loss
        else:
            assert out.ledger["nonfinite_units"] is None
