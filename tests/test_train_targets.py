"""Run targets and rule inputs of the training stage."""

from __future__ import annotations

from types import SimpleNamespace

from userdp.config import validate_config
from userdp.training.targets import finetune_inputs, pretrain_inputs, train_targets


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


def test_train_targets_cover_cells_and_rates():
    targets = train_targets(_config())
    ledgers = [t for t in targets if t.endswith("ledger.json")]
    # 2 methods x (2 eps + inf) x 1 budget + 2 G-sweep cells, x 2 learning rates
    assert len(ledgers) == (2 * 3 + 2) * 2
    assert "results/runs/d/method~uls/eps~0.5/budget~100/seed~0/lr~1e-05/ledger.json" in ledgers
    assert "results/runs/d/method~els/eps~inf/budget~100/seed~0/lr~0.001/model/model.safetensors" in targets
    assert "results/runs/d/method~uls/eps~1/budget~100/group~4/seed~0/lr~0.001/train_log.parquet" in targets
    assert "results/model/pretrained/model.safetensors" in targets
    named = train_targets(_config(model={"name": "some/model"}, tokenizer={"name": "some/model"}))
    assert not any(t.startswith("results/model/") for t in named)


def test_rule_inputs():
    cfg = _config()
    assert pretrain_inputs(cfg)["public"] == "results/data/d/public_tokens.parquet"
    wc = SimpleNamespace(**{"dataset": "d", "method": "uls", "eps": "1", "budget": "100", "group": "4",
                             "seed": "0", "lr": "0.001"})
    ins = finetune_inputs(cfg, wc)
    assert ins["plan"] == "results/plan/d/method~uls/eps~1/budget~100/group~4.json"
    assert ins["model"] == "results/model/pretrained/model.safetensors"
    wc = SimpleNamespace(**{"dataset": "d", "method": "els", "eps": "inf", "budget": "100", "seed": "0",
                             "lr": "0.001"})
    assert finetune_inputs(cfg, wc)["plan"] == "results/plan/d/method~els/eps~inf/budget~100.json"
    assert "model" not in finetune_inputs(_config(model={"name": "x/y"}, tokenizer={"name": "x/y"}), wc)
