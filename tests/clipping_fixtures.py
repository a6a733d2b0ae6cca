"""Tiny GPT-2 / Llama models, padded batches and a brute-force clipped-sum reference.

The reference runs one backward per unit (example or user), each row alone
and trimmed to its own length, then clips and sums by hand: exactly the
definition in docs/method.md sections 3-4, with no shared code path with
`userdp.training.clipping` except the row-loss formula (which is checked
separately against a hand-written loop).
"""

from __future__ import annotations

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 97
SEQ = 12


def tiny_gpt2(tied: bool = True, dtype: torch.dtype = torch.float64, seed: int = 0) -> GPT2LMHeadModel:
    """Two-layer GPT-2 (Conv1D layers, learned positions built as [1, L]), no dropout."""
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg).to(dtype)


def tiny_llama(tied: bool = False, dtype: torch.dtype = torch.float64, seed: int = 0) -> LlamaForCausalLM:
    """Two-layer Llama (RMSNorm, rotary, GQA, nn.Linear), pad_token_id=0 so padding_idx is exercised."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).to(dtype)


MODELS = {
    "gpt2-tied": lambda: tiny_gpt2(True),
    "gpt2-untied": lambda: tiny_gpt2(False),
    "llama-untied": lambda: tiny_llama(False),
    "llama-tied": lambda: tiny_llama(True),
}


def batch(level: str, dtype: torch.dtype = torch.float64, seed: int = 1):
    """A right-padded batch with varying lengths, a padding row (unit -1) and, for ULS,
    users with different numbers of rows (weights 1/m_u).

    level: "els" (one row per unit), "uls" (2, 2 and 1 rows per user, rows interleaved)
    or "uls-regular" (2 rows per user).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([SEQ, 5, 9, 1, 12, 7])
    ids = torch.randint(0, VOCAB, (6, SEQ), generator=g)
    ids[0, 3] = 0  # token 0 is Llama's padding_idx: its embedding row gets no gradient
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    units = {"els": [0, 1, 2, -1, 4, 5], "uls": [3, 0, 3, -1, 0, 7], "uls-regular": [3, 0, 3, -1, 0, 7]}[level]
    if level == "uls-regular":
        units = [3, 0, 3, 7, 0, 7]
    units = torch.tensor(units)
    weights = torch.ones(6, dtype=dtype)
    if level.startswith("uls"):
        for u in units.unique():
            sel = units == u
            weights[sel] = 1.0 / sel.sum()
    weights[units < 0] = 0.0
    return ids, mask, units, weights


def row_loss(model, ids_row: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one unpadded row, written out by hand."""
    logits = model(input_ids=ids_row[None]).logits[0]
    if ids_row.numel() < 2:
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return -logp.gather(1, ids_row[1:, None]).mean()


def per_unit_grads(model, ids, mask, units, weights) -> dict[int, list[torch.Tensor]]:
    """Brute force: for each unit, one backward of sum_{r in u} w_r loss_r, rows run alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for u in sorted(set(units.tolist()) - {-1}):
        loss = 0.0
        for r in (units == u).nonzero().flatten().tolist():
            n = int(mask[r].sum())
            loss = loss + weights[r] * row_loss(model, ids[r, :n])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        out[u] = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    return out


def clipped_sum(unit_grads: dict[int, list[torch.Tensor]], clip: float | None, normalize: bool):
    """sum_u clip(g_u) by hand; also returns the per-unit norms in unit order."""
    total = None
    norms = []
    for u in sorted(unit_grads):
        gs = unit_grads[u]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in gs))
        norms.append(norm)
        if clip is None:
            f = 1.0
        elif normalize:
            f = clip / norm
        else:
            f = min(1.0, clip / float(norm))
        scaled = [f * g for g in gs]
        total = scaled if total is None else [t + s for t, s in zip(total, scaled)]
    return total, torch.stack(norms)


def fresh(model):
    """A deep copy with no gradients."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    return m
