"""A user's own model with LoRA through the real workflow, as someone with a downloaded checkpoint runs it.

A tiny random Llama and its tokenizer are saved with save_pretrained into a
local folder; `model.name` and `tokenizer.name` point at it, `model.lora`
is set, and `snakemake` runs data, plans, ELS and ULS LoRA fine-tuning
(private and non-private) and evaluation. Each run folder holds peft's
adapter (not a copy of the base), the ledgers count only the adapter
parameters, and the evaluated model is base + adapter.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from train_fixtures import make_tokenizer

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _local_model(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from userdp.training import models

    vocab = make_tokenizer(folder.parent / "tok")
    tok = models.load_tokenizer(folder.parent / "tok")
    ids = models.special_ids(tok)
    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, **ids)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def test_local_llama_with_lora_through_the_pipeline(tmp_path):
    model_dir = tmp_path / "my-llama"
    _local_model(model_dir)
    config = {
        "seed": 0,
        "datasets": {"tiny": {"source": "synthetic", "split": {"validation": 0.15, "test": 0.15},
                              "synthetic": {"n_users": 200, "contributions_median": 4, "max_contributions": 32,
                                            "public_examples": 0}}},
        "tokenizer": {"name": str(model_dir), "sequence_length": 16},
        "model": {"name": str(model_dir), "lora": {"r": 4, "alpha": 8}},
        "grid": {"datasets": ["tiny"], "methods": ["els", "uls"], "epsilons": [4],
                 "budgets": [{"compute": 480, "steps": 8}], "seeds": [0], "nonprivate": True,
                 "group_size_sweep": []},
        "privacy": {"group_size": {"els": 4, "uls": 4}},
        "training": {"learning_rates": [0.01], "physical_batch_size": 32, "threads": 1, "device": "cpu"},
        "evaluation": {"max_users": 20},
    }
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(yaml.safe_dump(config))
    cells = [f"results/runs/tiny/method~{m}/eps~{e}/budget~480/seed~0/metrics.json"
             for m in ("els", "uls") for e in ("4", "inf")]
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(cfg), "--replace-workflow-config", "--cores", "2", *cells],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "rule pretrain" not in proc.stdout + proc.stderr  # the user's model is the base
    from transformers import AutoModelForCausalLM

    n_base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    for target in cells:
        cell = tmp_path / Path(target).parent
        run = cell / "lr~0.01"
        assert sorted(p.name for p in (run / "model").iterdir() if p.suffix != ".md") == [
            "adapter_config.json", "adapter_model.safetensors"]
        assert json.loads((run / "model" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
            str(model_dir)
        ledger = json.loads((cell / "ledger.json").read_text())
        assert 0 < ledger["trainable_parameters"] < n_base / 4
        assert ledger["adapter"]["r"] == 4 and "q_proj" in ledger["adapter"]["target_modules"]
        metrics = json.loads((cell / "metrics.json").read_text())
        assert math.isfinite(metrics["test_loss"])
        if "eps~4" in target:
            assert ledger["epsilon"] <= 4 * 1.001


def test_example_llama_lora_config_dry_runs(tmp_path):
    """config/examples/llama-lora.yaml on top of the default: the DAG has LoRA runs writing adapters."""
    folder = tmp_path / "models" / "Meta-Llama-3-8B"  # where the example expects the user's checkpoint
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model-00001-of-00004.safetensors").write_bytes(b"")  # start-up checks the weights are there
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "results/runs/stackoverflow/method~uls/eps~1/budget~1024000/seed~0/metrics.json",
         "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "-n",
         "--configfile", str(REPO / "config" / "config.yaml"), str(REPO / "config" / "examples" / "llama-lora.yaml")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "lr~0.0003/model/adapter_model.safetensors" in out and "rule pretrain" not in out
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", out, re.M)}
    # training.sweep_jobs: per_run, a job per rate (it trains and evaluates its run)
    assert jobs["finetune"] == 3 and "evaluate" not in jobs, out[-3000:]
    assert "lr~0.0003/eval.json" in out
