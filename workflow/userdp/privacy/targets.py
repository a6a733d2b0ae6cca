"""Inputs and params of the plan-stage rules, from the config (kept out of the .smk files)."""

from __future__ import annotations

from typing import Any


def counts_from_tokens(config: dict) -> bool:
    """With tokenizer.long_examples = chunk one example becomes several rows of
    tokens.parquet and the training pool bounds G over rows, so the planner
    (and the DP statistics) count rows there instead of users.parquet's examples."""
    return config["tokenizer"]["long_examples"] == "chunk"


def stats_private(config: dict) -> bool:
    """Whether privacy.contribution_stats.private is on."""
    return bool((config["privacy"].get("contribution_stats") or {}).get("private", False))


def plan_privacy_params(config: dict) -> dict[str, Any]:
    """The privacy settings that enter a plan's params.

    contribution_stats only when it is on (adding the key switched off leaves
    existing plans, hence trained runs, up to date); secret_seeds never (it
    changes where randomness comes from, not the plan).
    """
    private = stats_private(config)
    return {
        k: v for k, v in config["privacy"].items()
        if (k != "contribution_stats" or private) and k != "secret_seeds"
    }


def count_inputs(config: dict, dataset: str) -> dict[str, str]:
    """The file the train users' counts come from: tokens.parquet (chunk mode) or users.parquet."""
    if counts_from_tokens(config):
        return {"tokens": f"results/data/{dataset}/tokens.parquet"}
    return {"users": f"results/data/{dataset}/users.parquet"}


def plan_inputs(config: dict, dataset: str) -> dict[str, str]:
    """Inputs of a plan cell: the counts, contributions.json, and the DP histogram when it is on."""
    ins = dict(count_inputs(config, dataset), contributions=f"results/data/{dataset}/contributions.json")
    if stats_private(config):
        ins["contributions_dp"] = f"results/data/{dataset}/contributions_dp.json"
    return ins
