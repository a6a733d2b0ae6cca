"""What changes a fine-tuning run: rule finetune's params (its file sets: tests/test_rules.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from userdp.config import load_config, validate_config
from userdp.training.settings import RESULT_TRAINING_KEYS, TrainSettings
from userdp.training.targets import finetune_params


def _config(**over):
    cfg = {
        "datasets": {"d": {"source": "synthetic"}},
        "tokenizer": {"public_dataset": "d"},
        "grid": {"methods": ["els", "uls"], "epsilons": [1, 0.5], "budgets": [{"compute": 100, "steps": 5}],
                 "seeds": [0], "group_size_sweep": [4]},
        "training": {"learning_rates": [0.001, 1e-05]},
    }
    cfg.update(over)
    return validate_config(cfg)


# Rule finetune's `settings` param as it was before the result-changing keys were declared once
# (userdp.training.settings): its text must not change, or every user's fine-tuning jobs rerun.
FINETUNE_PARAMS_TEXT = {
    "config/config.yaml": (
        "{'model': {'architecture': 'gpt2', 'n_embd': 128, 'n_head': 4, 'n_layer': 2, 'pretrain': "
        "{'batch_size': 32, 'learning_rate': 0.001, 'steps': 300}, 'tie_embeddings': True}, 'secret_seeds': False, "
        "'seed': 0, 'sequence_length': 48, 'training': {'device': 'auto', 'optimizer': 'adam', 'precision': 'fp32', "
        "'schedule': 'constant', 'uls_examples_per_user': None, 'warmup_steps': 0}}"
    ),
    "tests/configs/tiny.yaml": (
        "{'model': {'architecture': 'gpt2', 'n_embd': 32, 'n_head': 2, 'n_layer': 1, 'pretrain': "
        "{'batch_size': 32, 'learning_rate': 0.003, 'steps': 40}, 'tie_embeddings': True}, 'secret_seeds': False, "
        "'seed': 0, 'sequence_length': 32, 'training': {'device': 'auto', 'optimizer': 'adam', 'precision': 'fp32', "
        "'schedule': 'constant', 'uls_examples_per_user': None, 'warmup_steps': 0}}"
    ),
}


@pytest.mark.parametrize("path", sorted(FINETUNE_PARAMS_TEXT))
def test_finetune_params_text_is_unchanged(path):
    """For the synthetic datasets of both configs (derived seeds, debug_step_log off) the text is unchanged."""
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / path)
    dataset = next(d for d, spec in cfg["datasets"].items() if spec["source"] == "synthetic")
    assert repr(finetune_params(cfg, dataset)) == FINETUNE_PARAMS_TEXT[path]


def test_secret_seeds_default_per_dataset_and_in_the_params():
    """privacy.secret_seeds null: secret for a non-synthetic source, derived for synthetic; explicit values win."""
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "config/config.yaml")  # synth (synthetic) and fortunes (real text)
    assert cfg["privacy"]["secret_seeds"] is None
    assert finetune_params(cfg, "synth")["secret_seeds"] is False
    assert finetune_params(cfg, "fortunes")["secret_seeds"] is True
    for value in (True, False):
        cfg = load_config(root / "config/config.yaml")
        cfg["privacy"]["secret_seeds"] = value
        assert {finetune_params(cfg, d)["secret_seeds"] for d in ("synth", "fortunes")} == {value}


def test_debug_step_log_enters_the_params_only_when_on():
    assert "debug_step_log" not in finetune_params(_config(), "d")
    assert finetune_params(_config(training={"learning_rates": [0.001], "debug_step_log": True}), "d")[
        "debug_step_log"] is True


def test_one_declaration_of_what_changes_a_run():
    """finetune params, TrainSettings and the checkpoint fingerprint all follow RESULT_TRAINING_KEYS."""
    cfg = _config()
    assert set(finetune_params(cfg, "d")["training"]) == set(RESULT_TRAINING_KEYS)
    settings = TrainSettings.from_config(cfg, 0.001)
    assert set(RESULT_TRAINING_KEYS) <= {f.name for f in dataclasses.fields(TrainSettings)}
    result = settings.result_settings()
    assert set(result) == set(RESULT_TRAINING_KEYS) | {"learning_rate", "sequence_length"}
    assert {k: result[k] for k in RESULT_TRAINING_KEYS} == finetune_params(cfg, "d")["training"]
    # keys that change no result are in neither (debug_step_log changes the log's columns, not the model)
    for key in ("physical_batch_size", "checkpoint_every", "log_every_s", "debug_step_log"):
        assert key not in result and key not in finetune_params(cfg, "d")["training"]
    assert settings.result_settings(device="cuda")["device"] == "cuda"
