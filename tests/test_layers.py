"""Layer handlers (userdp.training.layers): a new layer type is one decorated class.

A tiny Llama whose MLP output projections are a custom module is refused
until one `@register_layer` handler class is defined; then its clipped
per-unit sums equal the brute-force reference (one backward per unit,
tests/clipping_fixtures.py), by ghost norms and by instantiated per-unit
gradients. The `registry` fixture restores the registry afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipping_fixtures import batch, clipped_sum, fresh, per_unit_grads, tiny_llama
from userdp.training import grad_norms as gn
from userdp.training import layers
from userdp.training.clipping import ClippedGradients, UnsupportedModelError
from userdp.training.layers import DENSE, VECTOR, LayerHandler, register_layer

torch.set_num_threads(1)
RTOL = 1e-6


class GainLinear(nn.Module):
    """y = (x W^T) * gain: a linear map with a learned gain per output, which no built-in handler knows."""

    def __init__(self, linear: nn.Linear, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone())
        gain = 1.0 + 0.5 * torch.randn(linear.out_features, generator=gen, dtype=linear.weight.dtype)
        self.gain = nn.Parameter(gain)

    def forward(self, x):
        return (x @ self.weight.T) * self.gain


def _model() -> nn.Module:
    model = tiny_llama()
    gen = torch.Generator().manual_seed(5)
    for block in model.model.layers:
        block.mlp.down_proj = GainLinear(block.mlp.down_proj, gen)
    return model


@pytest.fixture
def registry():
    """The handler registry, restored after the test (in place: clipping.py holds the same list)."""
    saved = list(layers.LAYER_HANDLERS)
    yield layers.LAYER_HANDLERS
    layers.LAYER_HANDLERS[:] = saved


@pytest.mark.parametrize("level", ["els", "uls"])
@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_one_decorated_class_supports_a_new_layer(registry, level, method):
    model = _model()
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp\.down_proj\.weight \(.*GainLinear\)"):
        ClippedGradients(model, 1.0)

    @register_layer
    class GainLinearHandler(LayerHandler):
        """grad W = sum_t (gain * g_t) (x) x_t; grad gain = sum_t g_t * (W x_t)."""

        kind, label, roles = "gain_linear", "GainLinear", {"weight": DENSE, "gain": VECTOR}

        def matches(self, module):
            return type(module) is GainLinear

        def piece(self, module, role, x, g, dtype):
            if role == "weight":
                return gn.DenseRecord(row=g * module.gain.detach(), col=x)
            return g.to(dtype) * (x @ module.weight.detach().T).to(dtype)

    assert isinstance(GainLinearHandler, type) and type(registry[-1]) is GainLinearHandler
    b = batch(level)
    unit_grads = per_unit_grads(fresh(model), *b)
    clip = 0.5 * float(clipped_sum(unit_grads, None, False)[1].min())  # every unit is clipped
    want, want_norms = clipped_sum(unit_grads, clip, False)
    got = fresh(model)
    stats = ClippedGradients(got, clip, norm_method=method).accumulate(*b)
    params = [p for p in got.parameters() if p.requires_grad]
    assert len(params) == len(want)
    scale = max(float(w.abs().max()) for w in want)
    for p, w in zip(params, want):
        assert float((p.grad - w).abs().max()) <= RTOL * scale
    torch.testing.assert_close(stats.unit_norms, want_norms, rtol=RTOL, atol=0)


def test_register_layer_takes_a_handler_class():
    with pytest.raises(TypeError, match="LayerHandler subclass"):
        register_layer(layers.LinearHandler())


def test_builtin_handlers_are_tried_in_definition_order():
    """handler_for returns the first match, so the order is part of the behaviour (a plain nn.Embedding
    is EmbeddingHandler's before ScaledEmbeddingHandler checks for an embed_scale). Runs after the tests
    above, so it also shows that they left no handler behind."""
    assert [type(h) for h in layers.LAYER_HANDLERS] == [
        layers.LinearHandler, layers.Conv1DHandler, layers.EmbeddingHandler, layers.ScaledEmbeddingHandler,
        layers.OffsetPositionsHandler, layers.LayerNormHandler, layers.RMSNormHandler, layers.OffsetRMSNormHandler,
    ]
