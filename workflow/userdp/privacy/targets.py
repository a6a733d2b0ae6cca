"""What changes a plan: the params of the plan-stage rules (workflow/rules/plan.smk), from the config, and
where the train users' counts come from."""

from __future__ import annotations

from typing import Any

from ..io import sorted_dict
from .adaptive import ADAPTIVE
from .seed_secrecy import secret_seeds  # noqa: F401 (rule contribution_stats_dp's `secret` param)


def counts_from_tokens(config: dict) -> bool:
    """With tokenizer.long_examples = chunk one example becomes several rows of
    tokens.parquet and the training pool bounds G over rows, so the planner
    (and the DP statistics) count rows there instead of users.parquet's examples."""
    return config["tokenizer"]["long_examples"] == "chunk"


def stats_private(config: dict) -> bool:
    """Whether privacy.contribution_stats.private is on."""
    return bool((config["privacy"].get("contribution_stats") or {}).get("private", False))


def _group_rule(config: dict, method: str) -> Any:
    from .group_size import rule_for  # lazy: the accountant is heavy to import at DAG-building time

    return rule_for(config["privacy"], method)


def plan_privacy_params(config: dict, method: str, eps: str, group: str | None = None) -> dict[str, Any]:
    """The privacy.* settings that change the plan of one cell (rule plan's `privacy` param).

    Exactly what userdp.privacy.planner.plan_cell reads for this cell, so that
    changing any other key leaves the plan (and the runs trained from it) up
    to date:

    - delta, delta_exponent: every cell (delta is in every plan and ledger);
    - clip_norm, clipping: private cells only (eps~inf plans have no clipping);
      adaptive: only when clipping is "adaptive"; correlated_noise: only in ULS cells, when set;
    - calibration_tolerance, max_noise_multiplier: private cells, and cells whose
      G comes from the SNR rule (it calibrates sigma for each candidate G);
    - group_size: only this method's rule (plus snr_* when it is "snr"), and
      nothing for G-sweep cells (their G is the explicit `group` wildcard);
    - contribution_stats: only when it is on (adding the key switched off
      leaves existing plans up to date);
    - never `comparison` (it only feeds rule accounting_comparison) nor
      `secret_seeds` (it changes where the training randomness comes from,
      not the plan; rule finetune carries it, and rule contribution_stats_dp,
      whose release every plan of the dataset reads, carries it resolved per
      dataset by `secret_seeds`).
    """
    privacy = config["privacy"]
    private = eps != "inf"
    explicit = group is not None
    rule = _group_rule(config, method)
    snr = not explicit and rule == "snr"
    out: dict[str, Any] = {k: privacy.get(k) for k in ("delta", "delta_exponent")}
    if private:
        out.update({k: privacy.get(k) for k in ("clip_norm", "clipping")})
        if privacy.get("clipping") == ADAPTIVE:
            out["adaptive"] = privacy.get("adaptive")
        if method == "uls" and privacy.get("correlated_noise") is not None:
            out["correlated_noise"] = privacy.get("correlated_noise")
    if private or snr:
        out.update({k: privacy.get(k) for k in ("calibration_tolerance", "max_noise_multiplier")})
    if not explicit:
        gs = privacy.get("group_size") or {}
        chosen: dict[str, Any] = {method: rule}
        if snr:
            chosen.update({k: gs[k] for k in ("snr_noise_ratio", "snr_max_quantile", "snr_min_cohort") if k in gs})
        out["group_size"] = chosen
    if stats_private(config):
        out["contribution_stats"] = privacy["contribution_stats"]
    return sorted_dict(out)


def selection_param(config: dict) -> dict[str, Any]:
    """How a cell's learning-rate runs become the released model (rule plan's `selection` param).

    In the default `composed` mode the number of learning rates is part of it
    (each run is calibrated for the k runs composed); in `per_run` mode it is
    not, so changing the rates re-plans nothing.
    """
    from .selection import Selection  # lazy, like _group_rule

    return Selection.from_config(config["privacy"], config["training"]["learning_rates"]).record()


def reference_epsilon_param(config: dict, method: str, eps: str, group: str | None = None) -> float | None:
    """The reference epsilon of one cell (rule plan's `reference_epsilon` param), or None where unused.

    planner.plan_cell uses it only for a non-private (eps~inf) cell whose G
    comes from a rule: the SNR rule calibrates at that epsilon, and with DP
    contribution statistics on, the histogram's budget is checked against it.
    Every other cell gets None, so adding a larger epsilon to grid.epsilons
    re-plans only those cells, never the existing private ones.
    """
    if eps != "inf" or group is not None:
        return None
    if _group_rule(config, method) != "snr" and not stats_private(config):
        return None
    return max(float(e) for e in config["grid"]["epsilons"])


