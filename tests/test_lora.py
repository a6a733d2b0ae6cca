"""LoRA adapters (model.lora, peft): exact clipped sums, only the adapters train, the base stays bit-identical.

* Brute force: with adapters on GPT-2 (Conv1D), Llama and Qwen2, the clipped
  per-example (ELS) and per-user (ULS) sums over the adapter parameters equal
  one backward per unit, flat and normalized clipping, padding present.
* The real engine: after training only adapter coordinates changed (each of
  them: the noise covers every trainable coordinate), the base is
  bit-for-bit the base, the ledger counts the trainable parameters, the run
  saves peft's adapter and `load_model` merges it into its base with the same
  function; a checkpoint holds only the adapters and resumes bit-identically;
  an update that moves nothing fails loudly.
* Config: bad target modules are refused with the key named; rerun params.
"""

from __future__ import annotations

import pytest
import torch

from clipping_fixtures import batch, clipped_sum, fresh, per_unit_grads, tiny_gpt2, tiny_llama
from train_fixtures import SEQ, plan_for
from userdp.config import validate_config
from userdp.errors import ConfigError
from userdp.training import engine, models, run_seeds, run_state
from userdp.training.clipping import ClippedGradients
from userdp.training.gradients import MicroBatchStats
from userdp.training.settings import TrainSettings

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}


def _qwen2():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg).double()


BASES = {"gpt2": lambda: tiny_gpt2(True), "llama": lambda: tiny_llama(False), "qwen2": _qwen2}


def _with_adapters(base: torch.nn.Module) -> torch.nn.Module:
    """apply_lora as the pipeline does, then lora_B made non-zero (at init it is 0, and lora_A's gradient too)."""
    model = models.apply_lora(base, LORA, seed=0).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("arch", sorted(BASES))
@pytest.mark.parametrize("level", ["els", "uls"])
@pytest.mark.parametrize("normalize", [False, True])
def test_lora_clipped_sum_matches_bruteforce(arch, level, normalize):
    model = _with_adapters(BASES[arch]())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    want, norms = clipped_sum(per_unit_grads(fresh(model), *batch(level)), 0.05, normalize)
    got = fresh(model)
    stats = ClippedGradients(got, 0.05, normalize).accumulate(*batch(level))
    params = [p for p in got.parameters() if p.requires_grad]
    assert len(params) == len(want)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(stats.unit_norms.double(), norms, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in got.parameters() if not p.requires_grad)  # nothing on the frozen base
    assert float(norms.min()) > 0.05  # every unit is clipped: the test exercises the clip factors


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def pool():
    from train_fixtures import train_pool

    return train_pool(24, 5)


def _base():
    from train_fixtures import tiny_model

    return tiny_model("llama", tie=False)


def _train(pool, path, lr=1e-2, method="uls", **kw):
    model = models.apply_lora(_base(), LORA, seed=0)
    plan = plan_for(pool, method, expected=3.0, steps=4, sigma=0.8, clip=0.5)
    settings = TrainSettings(learning_rate=lr, physical_batch_size=8, sequence_length=SEQ, checkpoint_every=2,
                             device="cpu", log_every_s=0.0)
    seeds = run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, 3, lr)
    out = engine.train(model, pool, plan, settings, run_state.RunPaths(path), seeds, 0,
                       compute_epsilon=lambda e, d: 1.0, **kw)
    return model, out


@pytest.mark.parametrize("method", ["els", "uls"])
def test_only_adapters_train_and_the_base_is_bit_identical(pool, tmp_path, method):
    base = _base()
    start = models.apply_lora(_base(), LORA, seed=0)
    init = {n: p.detach().clone() for n, p in start.named_parameters()}
    model, out = _train(pool, tmp_path / "run", method=method)
    assert out.complete
    base_state = base.state_dict()
    n_adapter = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            n_adapter += p.numel()
            # the noise reaches every trainable coordinate, so each one moved
            assert bool((p.detach() != init[name]).all()), name
        else:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p.detach(), base_state[key]), name
    ledger = out.ledger
    assert ledger["trainable_parameters"] == n_adapter < sum(p.numel() for p in base.parameters())
    assert ledger["adapter"]["type"] == "lora" and ledger["adapter"]["r"] == 4
    assert "peft" in ledger["versions"] and ledger["versions"]["peft"] != "unknown"
    saved = tmp_path / "run" / "model"
    assert (saved / "adapter_config.json").exists() and (saved / "adapter_model.safetensors").exists()
    assert not (saved / "model.safetensors").exists()  # the adapter, not a copy of the base


def _train_saved_base(pool, tmp_path, method):
    """The base saved with save_pretrained, LoRA on it as loaded, two steps trained into tmp_path/run."""
    base_dir = tmp_path / "base"
    _base().save_pretrained(base_dir)
    model = models.apply_lora(models.load_model(base_dir), LORA, seed=0)
    plan = plan_for(pool, method, expected=3.0, steps=2, sigma=0.8, clip=0.5)
    settings = TrainSettings(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, device="cpu",
                             log_every_s=0.0)
    engine.train(model, pool, plan, settings, run_state.RunPaths(tmp_path / "run"),
                 run_seeds.run_seeds(0, 0, "t", method, "8", 100, 3, 0.01), 0, compute_epsilon=lambda e, d: 1.0)
    return base_dir, model


def test_saved_adapter_loads_on_its_base_and_merges_to_the_same_function(pool, tmp_path):
    base_dir, model = _train_saved_base(pool, tmp_path, "uls")
    ids = torch.randint(3, 40, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        merged = models.load_model(tmp_path / "run" / "model").eval()
        unmerged = models.load_model(tmp_path / "run" / "model", merge=False).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unmerged(input_ids=ids).logits, want, rtol=1e-6, atol=1e-6)
    assert not hasattr(merged, "peft_config")  # a plain model: evaluated at the base model's speed


def test_checkpoint_holds_only_the_adapters_and_resumes_bit_identically(pool, tmp_path):
    whole, _ = _train(pool, tmp_path / "a")
    _, part = _train(pool, tmp_path / "b", max_steps=3)
    assert not part.complete
    state = torch.load(tmp_path / "b" / "checkpoint" / "state.pt", weights_only=True)
    assert state["model"] and all("lora_" in k for k in state["model"])
    resumed, out = _train(pool, tmp_path / "b")
    assert out.complete and out.ledger["resumed_at_steps"] == [3]
    for (n, p), (_, q) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n


def test_an_update_that_moves_nothing_fails_loudly(pool, tmp_path):
    """No gradient reaches the trainable parameters and there is no noise: step 1 stops the run (not step T)."""
    class NoGradient:  # adapters that no gradient reaches (what a detached adapter would give)
        def __init__(self, model, clip_norm, normalize=False):
            self.params = [p for p in model.parameters() if p.requires_grad]

        def accumulate(self, input_ids, attention_mask, unit_ids, row_weights, loss_mask=None):
            for p in self.params:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            return MicroBatchStats(loss_sum=0.0, n_rows=int((unit_ids >= 0).sum()),
                                   n_units=int(torch.unique(unit_ids[unit_ids >= 0]).numel()))

    model = models.apply_lora(_base(), LORA, seed=0)
    plan = plan_for(pool, "uls", expected=3.0, steps=4, sigma=0.0, clip=None)
    settings = TrainSettings(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, device="cpu",
                             log_every_s=0.0)
    with pytest.raises(RuntimeError, match="step 1: the update changed none of the .* trainable parameters"):
        engine.train(model, pool, plan, settings, run_state.RunPaths(tmp_path / "run"),
                     run_seeds.run_seeds(0, 0, "t", "uls", "inf", 100, 3, 0.01), 0,
                     gradient_source=NoGradient, compute_epsilon=lambda e, d: 1.0)
    assert not (tmp_path / "run" / "ledger.json").exists()
    # a zero learning rate is a legitimate setting (replay tests, a warm-up's first step): not checked
    _, out = _train(pool, tmp_path / "zero", lr=0.0)
    assert out.complete


# ---------------------------------------------------------------- config


def test_default_targets_every_linear_layer_of_architectures_peft_has_no_default_for():
    from transformers import AutoModelForCausalLM, Phi3Config

    cfg = Phi3Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     vocab_size=97, max_position_embeddings=64, pad_token_id=0)
    model = models.apply_lora(AutoModelForCausalLM.from_config(cfg), LORA, seed=0)
    targets = {t.rsplit(".", 1)[-1] for t in model.peft_config["default"].target_modules}
    assert targets == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}  # not lm_head


def test_target_modules_that_match_nothing_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        models.apply_lora(tiny_llama(), dict(LORA, target_modules=["no_such_proj"]), seed=0)


def test_lora_keys_rerun_finetuning_but_not_pretraining():
    from userdp.training.targets import finetune_params, pretrain_params

    plain = validate_config({"datasets": {"s": {"source": "synthetic"}}})
    lora = validate_config({"datasets": {"s": {"source": "synthetic"}}, "model": {"lora": {"r": 4}}})
    assert pretrain_params(plain) == pretrain_params(lora)
    assert "lora" not in finetune_params(plain, "s")
    assert finetune_params(lora, "s")["lora"] == {"r": 4, "alpha": 16, "dropout": 0.0, "target_modules": None}
    bad = {"datasets": {"s": {"source": "synthetic"}}, "model": {"lora": {"r": 0}}}
    with pytest.raises(ConfigError, match="model.lora.r"):
        validate_config(bad)


def test_export_merged_writes_a_plain_model_equal_to_base_plus_adapter(pool, tmp_path, capsys):
    from userdp.cli import main

    base_dir, model = _train_saved_base(pool, tmp_path, "els")
    adapter = tmp_path / "run" / "model"
    assert main(["export-merged", str(adapter), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").exists() and not models.is_adapter(tmp_path / "merged")
    ids = torch.randint(3, 40, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(models.load_model(tmp_path / "merged").eval()(input_ids=ids).logits,
                                   model.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # nothing is overwritten, and a folder without an adapter is refused with the reason
    assert main(["export-merged", str(adapter), str(tmp_path / "merged")]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["export-merged", str(base_dir), str(tmp_path / "other")]) == 2
    assert "holds no LoRA adapter" in capsys.readouterr().err and not (tmp_path / "other").exists()


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_keeps_the_clipped_sums(arch, lora):
    model = _with_adapters(BASES[arch]()) if lora else BASES[arch]()
    want, norms = clipped_sum(per_unit_grads(fresh(model), *batch("uls")), 0.05, False)
    got = fresh(model)
    got.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got.train()
    stats = ClippedGradients(got, 0.05, False).accumulate(*batch("uls"))
    for p, w in zip([p for p in got.parameters() if p.requires_grad], want):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(stats.unit_norms.double(), norms, rtol=1e-9, atol=1e-12)


def test_reentrant_checkpointing_is_refused():
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ConfigError, match="only non-reentrant gradient checkpointing"):
        ClippedGradients(model, 1.0)


def test_training_gradient_checkpointing_trains_the_same_model(pool, tmp_path):
    from dataclasses import replace

    runs = []
    for name, on in (("off", False), ("on", True)):
        model = models.apply_lora(_base(), LORA, seed=0)
        plan = plan_for(pool, "els", expected=3.0, steps=3, sigma=0.8, clip=0.5)
        settings = TrainSettings(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, device="cpu",
                                 log_every_s=0.0)
        engine.train(model, pool, plan, replace(settings, gradient_checkpointing=on), run_state.RunPaths(tmp_path / name),
                     run_seeds.run_seeds(0, 0, "t", "els", "8", 100, 3, 0.01), 0, compute_epsilon=lambda e, d: 1.0)
        runs.append(model)
    assert runs[1].get_base_model().is_gradient_checkpointing and not runs[0].get_base_model().is_gradient_checkpointing
    for (n, p), (_, q) in zip(runs[0].named_parameters(), runs[1].named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
