"""The architecture matrix: today's decoders, full fine-tuning and LoRA, ELS and ULS, against brute force.

Tiny random configs built with transformers' own config classes (no
download): GPT-2 (Conv1D, learned positions), Llama, Mistral, Qwen2, Qwen3
(per-head q/k RMSNorm), Gemma, Gemma 2 and Gemma 3 ((1 + weight) RMSNorm,
scaled embedding, soft-capping; Gemma 3's q/k norms on [B, H, L, D]), Phi-3 (fused qkv and gate/up projections),
GPT-NeoX (Pythia), OPT (learned positions with an offset, tokens flattened
in the feed-forward block) and OLMo 2, tied and untied embeddings. For each,
the clipped per-unit sums of DP clipping equal one backward per example
(ELS) or per user (ULS) on a padded batch, and the per-unit norms match.
Gemma computes its norms in float32 inside a float64 model, so its
tolerance is float32's.
"""

from __future__ import annotations

import pytest
import torch

from clipping_fixtures import VOCAB, batch, clipped_sum, fresh, per_unit_grads
from userdp.training import models
from userdp.training.clipping import ClippedGradients

SPECIAL = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def _config(arch: str):
    import transformers as T

    if arch == "gpt2":
        return T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **SPECIAL)
    if arch == "llama-tied":
        return T.LlamaConfig(**DECODER, tie_word_embeddings=True, **SPECIAL)
    if arch == "gptneox":
        return T.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               max_position_embeddings=64, **SPECIAL)
    if arch == "opt":
        return T.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                           **SPECIAL)
    classes = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
               "gemma": T.GemmaConfig, "gemma2": T.Gemma2Config, "gemma3": T.Gemma3TextConfig, "phi3": T.Phi3Config,
               "olmo2": T.Olmo2Config}
    extra = {"head_dim": 8} if arch in ("qwen3", "gemma", "gemma2", "gemma3") else {}
    if arch == "gemma3":
        extra["sliding_window"] = 4  # its local-attention layers, shorter than the test rows
    return classes[arch](**DECODER, **extra, **SPECIAL)


ARCHS = ["gpt2", "llama", "llama-tied", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gptneox",
         "opt", "olmo2"]


def _model(arch: str, lora: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch)).double()
    if not lora:
        return model
    model = models.apply_lora(model, {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}, seed=0).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B starts at 0 (so would lora_A's gradient): make it non-zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("level", ["els", "uls"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_clipped_sums_match_bruteforce(arch, lora, level):
    model = _model(arch, lora)
    unit_grads = per_unit_grads(fresh(model), *batch(level))
    clip = 0.5 * float(clipped_sum(unit_grads, None, False)[1].min())  # every unit is clipped
    want, norms = clipped_sum(unit_grads, clip, False)
    got = fresh(model)
    stats = ClippedGradients(got, clip, False).accumulate(*batch(level))
    params = [(n, p) for n, p in got.named_parameters() if p.requires_grad]
    assert len(params) == len(want) > 0
    if lora:
        assert all("lora_" in n for n, _ in params)
    rtol = 1e-6 if arch.startswith("gemma") else 1e-9
    scale = max(float(w.abs().max()) for w in want)
    for (name, p), w in zip(params, want):
        # absolute tolerance on the gradient's scale: some coordinates are zero up to rounding (OPT's key bias)
        torch.testing.assert_close(p.grad, w, rtol=rtol, atol=rtol * scale, msg=name)
    torch.testing.assert_close(stats.unit_norms.double(), norms, rtol=rtol, atol=0.0)


@pytest.fixture(scope="module")
def pool():
    from train_fixtures import train_pool

    return train_pool(24, 5)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_saved_checkpoint_trains_with_lora_and_reloads_merged(arch, pool, tmp_path):
    """The user's way in: a folder saved with save_pretrained, loaded by the pipeline's loader, LoRA applied,
    trained by the real engine (real clipping, noise), the adapter saved and reloaded merged on its base."""
    from train_fixtures import SEQ, plan_for
    from userdp.training import engine, run_seeds, run_state
    from userdp.training.settings import TrainSettings

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(arch)).save_pretrained(tmp_path / "base")
    model = models.apply_lora(models.load_model(tmp_path / "base"), {"r": 4, "alpha": 8, "dropout": 0.0,
                                                                     "target_modules": None}, seed=0)
    plan = plan_for(pool, "uls", expected=3.0, steps=2, sigma=0.8, clip=0.5)
    settings = TrainSettings(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, device="cpu",
                             log_every_s=0.0)
    out = engine.train(model, pool, plan, settings, run_state.RunPaths(tmp_path / "run"),
                       run_seeds.run_seeds(0, 0, "t", "uls", "8", 100, 3, 0.01), 0, compute_epsilon=lambda e, d: 1.0)
    assert out.complete and out.ledger["adapter"]["type"] == "lora"
    ids = torch.randint(3, 40, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = models.load_model(tmp_path / "run" / "model").eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
