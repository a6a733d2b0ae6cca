"""The model card (README.md) of a released model: every fact from the ledger (change a field, the card
changes), Hugging Face metadata, what the epsilon covers and does not, and the non-private reference."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from userdp.training import model_card

LEDGER = {
    "method": "uls", "sampling_rate": 0.125, "noise_multiplier": 1.75, "clip_norm": 1.0, "clipping": "flat",
    "group_size": 8, "steps_completed": 20, "steps_planned": 20, "complete": True, "delta": 1e-5,
    "accountant": "pld_poisson_subsampled_gaussian", "epsilon": 3.98, "expected_batch": 31.5,
    "selection": {"accounting": "composed", "candidates": 1}, "seeds_mode": "secret", "guarantee_caveat": None,
    "learning_rate": 0.001, "optimizer": "adam", "n_train_users": 252, "trainable_parameters": 2048,
    "adapter": {"type": "lora", "r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["c_attn"],
                "base_model": "gpt2"},
    "versions": {"userdp": "0.1.0", "userdp_code": "0123456789abcdef", "torch": "2.13.0"},
}

#: (ledger path, new value): each must change the rendered card.
CHANGES = [
    (("method",), "els"), (("sampling_rate",), 0.5), (("noise_multiplier",), 0.9), (("clip_norm",), 0.25),
    (("clipping",), "normalized"), (("group_size",), 3), (("steps_completed",), 7), (("steps_planned",), 40),
    (("complete",), False), (("delta",), 1e-7), (("accountant",), "rdp"), (("epsilon",), 1.5),
    (("expected_batch",), 12.0), (("selection",), {"accounting": "per_run"}), (("seeds_mode",), "derived"),
    (("guarantee_caveat",), "seeds derived from the config seed"), (("learning_rate",), 0.02),
    (("optimizer",), "sgd"), (("n_train_users",), 999), (("trainable_parameters",), 77),
    (("adapter",), None), (("adapter", "r"), 4), (("adapter", "base_model"), "org/other"),
    (("versions", "userdp_code"), "fedcba9876543210"), (("versions", "torch"), "2.14.0"),
    (("contribution_stats",), {"epsilon": 0.1, "mechanism": "laplace histogram"}),
    (("epsilon_meaning",), "the 3 learning-rate runs composed"), (("learning_rates_tried",), 3),
    (("loss_tokens",), "answers"),
]


@pytest.mark.parametrize("path,value", CHANGES, ids=[".".join(p) for p, _ in CHANGES])
def test_every_card_field_comes_from_the_ledger(path, value):
    before = model_card.render(LEDGER)
    changed = copy.deepcopy(LEDGER)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    if path == ("learning_rates_tried",):
        changed["selection"] = {"accounting": "composed", "candidates": 3}
        before = model_card.render({**LEDGER, "selection": changed["selection"]})
    assert model_card.render(changed) != before, path


def test_the_card_is_a_hugging_face_model_card():
    text = model_card.render(LEDGER)
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert {"differential-privacy", "user-level-dp", "uls"} <= set(meta["tags"])
    assert meta["library_name"] == "peft" and meta["base_model"] == "gpt2"
    assert "(epsilon, delta) = (3.98, 1e-05)" in text and "all examples of one user" in text
    assert "| contribution bound G | 8 examples per user |" in text
    assert "| 1 example per user |" in model_card.render({**LEDGER, "group_size": 1})
    assert "each user included with probability 0.125" in text and "| noise multiplier | 1.75 |" in text
    assert "the public data the base model was pretrained on" in text and "secret seeds" in text
    assert "not the contribution statistics" in text and "code 0123456789abcdef" in text
    assert "No audit was run" in text
    # a local base model path means nothing on a model page: not in the metadata
    local = copy.deepcopy(LEDGER)
    local["adapter"]["base_model"] = "/home/me/ckpt"
    assert "base_model" not in yaml.safe_load(model_card.render(local).split("---\n")[1])


def test_derived_seeds_and_per_run_selection_are_said_plainly():
    led = {**LEDGER, "seeds_mode": "derived", "guarantee_caveat": "seeds derived from the config seed: anyone",
           "selection": {"accounting": "per_run"}}
    text = model_card.render(led)
    assert "derived seeds" in text and "anyone who can regenerate the randomness" in text
    assert "choosing among several runs on the private data is NOT covered" in text


def test_an_audit_result_is_shown_when_one_ran():
    text = model_card.render(LEDGER, audit={"epsilon_lower_bound": 0.42, "verdict": "within the claim"})
    assert "epsilon_lower_bound: 0.42" in text and "within the claim" in text and "No audit" not in text


def test_the_non_private_reference_says_it_has_no_guarantee():
    led = {**LEDGER, "noise_multiplier": 0.0, "epsilon": math.inf, "clip_norm": None, "clipping": None}
    text = model_card.render(led)
    assert "No privacy guarantee" in text and "Do not release it as private" in text
    assert model_card.card_facts(led)["epsilon"] == math.inf


def test_card_facts_are_the_ledger_values():
    facts = model_card.card_facts(LEDGER)
    for key in ("method", "group_size", "sampling_rate", "noise_multiplier", "clip_norm", "accountant", "delta",
                "epsilon", "seeds_mode"):
        assert facts[key] == LEDGER[key], key
    assert facts["steps"] == LEDGER["steps_completed"] and facts["code_digest"] == "0123456789abcdef"


def test_a_ledger_without_the_guarantee_is_refused_naming_the_fields():
    from userdp.errors import DataError

    with pytest.raises(DataError, match=r"lacks \['epsilon', 'noise_multiplier'\]"):
        model_card.render({k: v for k, v in LEDGER.items() if k not in ("epsilon", "noise_multiplier")})
