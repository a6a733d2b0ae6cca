"""ClippedGradients contract: accumulation across calls, frozen parameters,
unsupported layers, statistics, autocast, and the model left as it was found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipping_fixtures import batch, clipped_sum, fresh, per_unit_grads, row_loss, tiny_gpt2, tiny_llama
from userdp.training.clipping import ClippedGradients, UnsupportedModelError, row_losses

torch.set_num_threads(1)


def _split(b, rows):
    ids, mask, units, w = b
    return ids[rows], mask[rows], units[rows], w[rows]


def test_two_calls_add_up_and_frozen_params_untouched():
    model = tiny_gpt2(tied=True)
    frozen = [model.transformer.wpe.weight, model.transformer.h[0].ln_1.bias]
    for p in frozen:
        p.requires_grad_(False)
    sentinel = [torch.full_like(p, 7.0) for p in frozen]
    for p, s in zip(frozen, sentinel):
        p.grad = s.clone()
    b = batch("uls")
    want, _ = clipped_sum(per_unit_grads(fresh(model), *b), 0.05, False)
    # users 3 and 0 in the first call (with the padding row), user 7 in the second
    first, second = [0, 1, 2, 3, 4], [5]
    cg = ClippedGradients(model, 0.05)
    s1 = cg.accumulate(*_split(b, first))
    s2 = cg.accumulate(*_split(b, second))
    assert (s1.n_units, s2.n_units, s1.n_rows, s2.n_rows) == (2, 1, 4, 1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(want)
    scale = max(float(w.abs().max()) for w in want)
    for p, w in zip(trainable, want):
        assert float((p.grad - w).abs().max()) <= 1e-6 * scale
    for p, s in zip(frozen, sentinel):
        assert torch.equal(p.grad, s)
        assert not p.requires_grad


def test_model_state_restored_and_no_hooks_left():
    model = tiny_llama()
    ClippedGradients(model, 1.0).accumulate(*batch("els"))
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())
    # a failing call (left padding) also leaves the model intact
    ids, mask, units, w = batch("els")
    with pytest.raises(ValueError, match="right-padded"):
        ClippedGradients(model, 1.0).accumulate(ids, mask.flip(1), units, w)
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_stats_loss_sum_and_norms():
    model = tiny_llama()
    b = batch("uls")
    ids, mask, units, w = b
    stats = ClippedGradients(model, 1e9).accumulate(*b)
    want = 0.0
    with torch.no_grad():
        for r in range(ids.shape[0]):
            if units[r] >= 0:
                want += float(row_loss(model, ids[r, : int(mask[r].sum())]))
    assert stats.loss_sum == pytest.approx(want, rel=1e-9)
    assert stats.n_rows == 5 and stats.n_units == 3
    assert stats.unit_norms.shape == (3,)
    assert stats.clipped_fraction == 0.0


def test_row_losses_definition():
    """Row loss counts target t+1 only when t and t+1 are inside the mask."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    losses, n_valid = row_losses(logits, ids, mask)
    logp = torch.log_softmax(logits, -1)
    want0 = -(logp[0, 0, 2] + logp[0, 1, 3]) / 2
    torch.testing.assert_close(losses[0], want0)
    assert float(losses[1]) == 0.0
    assert n_valid.tolist() == [2, 0]


def test_empty_batch_creates_zero_grads():
    model = tiny_gpt2()
    ids, mask, units, w = batch("els")
    stats = ClippedGradients(model, 1.0).accumulate(ids, mask, torch.full_like(units, -1), w)
    assert stats.n_units == 0 and stats.loss_sum == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_padding_rows_contribute_nothing():
    """A row with unit -1 may hold anything: the result equals the batch without it."""
    model = tiny_gpt2()
    ids, mask, units, w = batch("els")
    ClippedGradients(model, 0.1).accumulate(ids, mask, units, w)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ids2 = ids.clone()
    ids2[3] = torch.arange(ids.shape[1])  # the padding row: different tokens, full mask, weight 5
    mask2 = mask.clone()
    mask2[3] = 1
    w2 = w.clone()
    w2[3] = 5.0
    ClippedGradients(model, 0.1).accumulate(ids2, mask2, units, w2)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.scale


class OddRMSNorm(nn.Module):
    """RMSNorm with (0.5 + weight) scaling: looks like an RMSNorm but is neither Llama's nor Gemma's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (0.5 + self.weight)


def test_unsupported_module_raises_clear_error():
    model = tiny_gpt2()
    model.transformer.h[1].mlp.c_fc = _Scaled(model.transformer.h[1].mlp.c_fc)
    with pytest.raises(UnsupportedModelError, match=r"h\.1\.mlp\.c_fc\.scale .*_Scaled"):
        ClippedGradients(model, 1.0)
    # freezing the offending parameter makes the model usable
    model.transformer.h[1].mlp.c_fc.scale.requires_grad_(False)
    ClippedGradients(model, 1.0)


def test_rmsnorm_variant_is_checked_not_assumed():
    model = tiny_llama()
    model.model.norm = OddRMSNorm(32).double()
    with pytest.raises(UnsupportedModelError, match="OddRMSNorm"):
        ClippedGradients(model, 1.0)


def test_changed_trainable_set_is_refused():
    model = tiny_gpt2()
    cg = ClippedGradients(model, 1.0)
    model.transformer.wpe.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="trainable parameters changed"):
        cg.accumulate(*batch("els"))


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
@pytest.mark.parametrize("level", ["els", "uls"])
def test_bf16_autocast_close_to_float32(make, level):
    """Under torch.autocast(bf16) the clipped sum stays close to the float32 one."""
    model32 = make(dtype=torch.float32)
    b = batch(level, dtype=torch.float32)
    ref = fresh(model32)
    stats32 = ClippedGradients(ref, 0.5).accumulate(*b)
    model = fresh(model32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stats16 = ClippedGradients(model, 0.5).accumulate(*b)
    torch.testing.assert_close(stats16.unit_norms.float(), stats32.unit_norms, rtol=5e-2, atol=0)
    num = sum(float((p.grad - q.grad).square().sum()) for p, q in zip(model.parameters(), ref.parameters()))
    den = sum(float(q.grad.square().sum()) for q in ref.parameters())
    assert num**0.5 <= 5e-2 * den**0.5
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
