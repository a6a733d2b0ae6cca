"""Invariant 4 (docs/method.md section 10): clipped per-example (ELS) and per-user (ULS)
sums equal a brute-force reference (one backward per unit), on GPT-2 and Llama,
tied and untied embeddings, with GPT-2's broadcast position ids, right padding
of varying lengths, padding rows, and every norm formula."""

from __future__ import annotations

import functools

import pytest
import torch

from clipping_fixtures import MODELS, batch, clipped_sum, fresh, per_unit_grads
from userdp.training import grad_norms
from userdp.training.clipping import ClippedGradients

torch.set_num_threads(1)
RTOL = 1e-6


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return MODELS[name]()


@functools.lru_cache(maxsize=None)
def _reference(name: str, level: str):
    model = fresh(_model(name))
    return per_unit_grads(model, *batch(level))


def _assert_close(params, want, rtol=RTOL):
    assert len(params) == len(want)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    for p, w in zip(params, want):
        assert p.grad is not None
        err = float((p.grad - w).abs().max())
        assert err <= rtol * scale, f"max abs error {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("level", ["els", "uls", "uls-regular"])
@pytest.mark.parametrize("method", ["auto", "ghost", "instantiate", "mixed"])
@pytest.mark.parametrize("clip,normalize", [(1e-3, False), (1e4, False), (0.3, True)])
def test_clipped_sum_matches_bruteforce(name, level, method, clip, normalize, monkeypatch):
    if method == "mixed":
        # every matrix (tied embeddings included): ghost norm for the users with
        # one row, instantiation for the users with two
        plan = grad_norms.plan_param

        def mixed(param, has_dense, has_index, layout, requested):
            st = plan(param, has_dense, has_index, layout, "instantiate")
            if st.kind == "matrix" and len(layout.groups) > 1:
                st.n_ghost, st.unit_grads = 1, st.unit_grads[1:]
            return st

        monkeypatch.setattr(grad_norms, "plan_param", mixed)
        method = "auto"
    unit_grads = _reference(name, level)
    want, want_norms = clipped_sum(unit_grads, clip, normalize)
    model = fresh(_model(name))
    stats = ClippedGradients(model, clip, normalize, norm_method=method).accumulate(*batch(level))
    params = [p for p in model.parameters() if p.requires_grad]
    _assert_close(params, want)
    torch.testing.assert_close(stats.unit_norms, want_norms, rtol=RTOL, atol=0)
    # the small clip norm clips every unit, the large one none
    expect_clipped = float((want_norms > clip).double().mean())
    assert stats.clipped_fraction == pytest.approx(expect_clipped)
    if not normalize:
        assert expect_clipped in (0.0, 1.0)
    assert stats.n_units == len(unit_grads)
    assert stats.n_rows == (6 if level == "uls-regular" else 5)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("level", ["els", "uls"])
def test_nonprivate_is_plain_weighted_gradient(name, level):
    want, _ = clipped_sum(_reference(name, level), None, False)
    model = fresh(_model(name))
    stats = ClippedGradients(model, None).accumulate(*batch(level))
    _assert_close([p for p in model.parameters() if p.requires_grad], want)
    assert stats.unit_norms.numel() == 0
    assert stats.clipped_fraction == 0.0


def test_tied_embedding_cross_term_matters():
    """The tied test above is not vacuous: with the same weights untied, the
    per-unit norms differ (the cross term between the input-embedding and
    lm_head gradients of the shared matrix is not zero)."""
    tied = fresh(_model("gpt2-tied"))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    untied = fresh(_model("gpt2-untied"))
    untied.load_state_dict({k: v.clone() for k, v in tied.state_dict().items()})
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    torch.testing.assert_close(untied.lm_head.weight, tied.transformer.wte.weight)
    _, want = clipped_sum(per_unit_grads(fresh(tied), *batch("els")), 1.0, False)
    n_tied = ClippedGradients(tied, 1.0).accumulate(*batch("els")).unit_norms
    n_untied = ClippedGradients(untied, 1.0).accumulate(*batch("els")).unit_norms
    torch.testing.assert_close(n_tied, want, rtol=RTOL, atol=0)
    # every unit differs by far more than the test tolerance
    assert (n_tied - n_untied).abs().min() > 10 * RTOL * n_tied.max()
