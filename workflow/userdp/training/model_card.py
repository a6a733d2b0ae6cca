"""The model card of a released model: a Hugging Face README.md rendered from its ledger alone.

Every folder that releases a model (a pipeline run folder and its cell
folder, `userdp.fine_tune`'s output_dir, `PrivateTraining.save`,
`UserDPTrainer.save_model`) gets `README.md` in the model-card form the
Hugging Face hub reads: YAML metadata (`library_name`, `base_model`, `tags`
with `differential-privacy` and `user-level-dp`) and a body that says, in
words a person reads on a model page, the guarantee and its privacy unit,
the mechanism that ran, what the epsilon covers and what it does not,
whether the randomness was secret, and the code that ran. Every fact comes
from the ledger (`render(ledger)`; docs/artifacts.md "Runs" lists its
fields): change a ledger field and the card changes; nothing is computed
here that the ledger does not record. `card_facts(ledger)` is the same facts
as a dict (what `userdp.load_released(..., with_ledger=True)` callers and
tests read).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

#: The card's file name, beside ledger.json (and in the model folder, replacing peft's empty template).
CARD = "README.md"
TAGS = ("differential-privacy", "user-level-dp", "dp-sgd", "userdp")
METHOD_NAMES = {"els": "DP-SGD with example-level sampling (ELS)", "uls": "DP-SGD with user-level sampling (ULS)"}
SAMPLED_UNIT = {"els": "example of the user-bounded pool", "uls": "user"}
#: The ledger fields a card cannot do without: the guarantee and the mechanism.
REQUIRED = ("epsilon", "delta", "method", "group_size", "sampling_rate", "steps_completed", "noise_multiplier")
#: What no run's epsilon covers: choices and data outside the mechanism.
NOT_COVERED = (
    "the public data the base model was pretrained on, and the base model itself",
    "the tokenizer and any choice made outside this run (the model, the data's preparation, the hyperparameters "
    "tried before it, which users were held out)",
    "statistics of the private data that were logged or printed outside the released files (for example the "
    "training loss of `stats.loss` or Trainer's logs): they are noise-free functions of the sampled users",
)


#: The ledger's `loss_tokens` (absent: text rows) -> what the card says the loss was on.
LOSS_TOKENS = {None: "next-token cross-entropy on every token of each example",
               "answers": "next-token cross-entropy on the answer tokens only (chat rows: the assistant's "
                          "messages; instruction rows: the completions)"}


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    value = float(value)
    if math.isinf(value):
        return "infinite"
    return f"{value:.{digits}g}"


def card_facts(ledger: Mapping[str, Any], audit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The facts of the card, each read from the ledger (or the `audit` record): a flat dict."""
    missing = [k for k in REQUIRED if k not in ledger]
    if missing:
        from ..errors import DataError

        raise DataError(f"the ledger lacks {missing}, which the model card states; it is damaged or was not written "
                        "by userdp: retrain the run (or restore its ledger.json).")
    selection = ledger.get("selection") or {}
    stats = ledger.get("contribution_stats") or None
    adapter = ledger.get("adapter") or None
    versions = ledger.get("versions") or {}
    method = str(ledger.get("method"))
    private = float(ledger.get("noise_multiplier") or 0.0) > 0
    return {
        "private": private,
        "epsilon": float(ledger["epsilon"]) if private else math.inf,
        "delta": float(ledger["delta"]),
        "privacy_unit": "all examples of one user (user-level DP)",
        "method": method,
        "method_name": (METHOD_NAMES.get(method, method) if not ledger.get("correlated_noise") else
                        "DP-FTRL with banded correlated noise and user-level sampling (ULS)"),
        "sampled_unit": SAMPLED_UNIT.get(method, method),
        "group_size": int(ledger["group_size"]),
        "sampling_rate": float(ledger["sampling_rate"]),
        "steps": int(ledger["steps_completed"]),
        "steps_planned": int(ledger.get("steps_planned", ledger["steps_completed"])),
        "complete": bool(ledger.get("complete", True)),
        "noise_multiplier": float(ledger["noise_multiplier"]),
        **{k: ledger.get(k) for k in ("clip_norm", "clipping", "adaptive_clipping", "correlated_noise", "accountant",
                                      "expected_batch", "epsilon_meaning", "epsilon_target_of")},
        "learning_rate_selection": selection.get("accounting"),
        "learning_rate_candidates": selection.get("candidates"),
        "learning_rates_tried": ledger.get("learning_rates_tried"),
        "contribution_stats": None if not stats else {"epsilon": stats.get("epsilon"),
                                                      "mechanism": stats.get("mechanism")},
        "seeds_mode": ledger.get("seeds_mode"),
        "guarantee_caveat": ledger.get("guarantee_caveat"),
        "adapter": None if not adapter else dict(adapter),
        "base_model": (adapter or {}).get("base_model"),
        **{k: ledger.get(k) for k in ("trainable_parameters", "learning_rate", "optimizer", "n_train_users",
                                      "loss_tokens")},
        "userdp_version": versions.get("userdp"),
        "code_digest": versions.get("userdp_code"),
        "versions": dict(versions),
        "audit": None if audit is None else dict(audit),
    }


def _metadata(f: Mapping[str, Any]) -> str:
    import yaml

    meta: dict[str, Any] = {"library_name": "peft" if f["adapter"] else "transformers"}
    if f["base_model"] and not os.path.isabs(str(f["base_model"])):
        meta["base_model"] = str(f["base_model"])  # a hub id; a local path means nothing on a model page
    meta["tags"] = list(TAGS) + [f["method"]]
    meta["pipeline_tag"] = "text-generation"
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _guarantee(f: Mapping[str, Any]) -> list[str]:
    if not f["private"]:
        return ["**No privacy guarantee.** This is a non-private reference run (noise multiplier 0, no clipping): "
                "it shows what the same training reaches without DP. Do not release it as private."]
    lines = [f"**User-level (epsilon, delta) = ({_num(f['epsilon'])}, {_num(f['delta'], 3)}) differential "
             f"privacy.** The privacy unit is {f['privacy_unit']}: adding or removing every example of any one user "
             "changes the probability of any output of the training by at most a factor e^epsilon, plus delta."]
    if f["epsilon_meaning"]:
        lines.append(f"The epsilon is that of {f['epsilon_meaning']}.")
    elif f["learning_rate_candidates"] and int(f["learning_rate_candidates"]) > 1:
        lines.append(f"The epsilon is this one run's. It is one of {f['learning_rate_candidates']} learning-rate "
                     "runs; the model released from them (the cell's ledger) carries the guarantee of that choice.")
    if not f["complete"]:
        lines.append(f"The run stopped after {f['steps']} of {f['steps_planned']} planned steps; the epsilon is "
                     "that of the steps that ran.")
    return lines


def render(ledger: Mapping[str, Any], *, title: str | None = None, audit: Mapping[str, Any] | None = None) -> str:
    """The README.md model card of the model whose ledger is `ledger` (audit: the audit's record, if one ran)."""
    f = card_facts(ledger, audit)
    name = title or ("User-level DP fine-tuned model" if f["private"] else "Non-private reference model")
    out = [_metadata(f), f"# {name}", "", "## Privacy guarantee", ""]
    out += [" ".join(_guarantee(f)), ""]
    out += ["| | |", "|---|---|",
            f"| privacy unit | {f['privacy_unit']} |",
            f"| epsilon | {_num(f['epsilon'])} |",
            f"| delta | {_num(f['delta'], 3)} |",
            f"| method | {f['method_name']} |",
            f"| contribution bound G | {f['group_size']} example{'s' if f['group_size'] != 1 else ''} per user |",
            f"| sampling | {_sampling_text(f)} |",
            f"| steps | {f['steps']} (planned {f['steps_planned']}) |",
            f"| noise multiplier | {_num(f['noise_multiplier'])}{_correlated_text(f['correlated_noise'])} |",
            f"| clip norm | {_num(f['clip_norm'])} ({f['clipping'] or 'no'} clipping, per "
            f"{'user' if f['method'] == 'uls' else 'example'}"
            f"{_adaptive_text(f['adaptive_clipping'])}) |",
            f"| accountant | {f['accountant'] or 'none'} |",
            f"| randomness | {f['seeds_mode']} seeds |", ""]
    out += ["## What the epsilon covers", ""]
    covered = ["every noisy step of this training (its sampled units, clipped gradients and noise)"]
    if f["learning_rate_selection"] and f["learning_rate_selection"] != "per_run" and f["learning_rates_tried"]:
        covered.append(f"the choice among {f['learning_rates_tried']} learning-rate runs "
                       f"({f['learning_rate_selection']} accounting)")
    elif f["learning_rate_selection"] == "per_run":
        covered.append("one learning-rate run only (per_run accounting): choosing among several runs on the "
                       "private data is NOT covered")
    if f["contribution_stats"]:
        covered.append(f"the DP contribution statistics used to plan the run (epsilon "
                       f"{_num(f['contribution_stats']['epsilon'])}, {f['contribution_stats']['mechanism']})")
    else:
        covered.append("not the contribution statistics: G and the sampling rate were planned from the users' exact "
                       "example counts (enable privacy.contribution_stats.private to cover them)")
    out += [f"- {c}" for c in covered] + ["", "It does not cover:", ""]
    out += [f"- {c}" for c in NOT_COVERED]
    if f["guarantee_caveat"]:
        out += [f"- anyone who can regenerate the randomness: {f['guarantee_caveat']}"]
    out += ["", "## Training", ""]
    what = (f"LoRA adapter (r {f['adapter'].get('r')}, alpha {_num(f['adapter'].get('alpha'))}, on "
            f"{', '.join(f['adapter'].get('target_modules') or [])})" if f["adapter"] else "every parameter")
    out += [f"- base model: {f['base_model'] or 'not recorded (full fine-tuning of the model given)'}",
            f"- trained: {what}; {f['trainable_parameters']} trainable parameters",
            f"- loss: {LOSS_TOKENS.get(f['loss_tokens'], f['loss_tokens'])}",
            f"- optimizer: {f['optimizer'] or 'not recorded'}, learning rate {_num(f['learning_rate'])}",
            f"- train users: {f['n_train_users']}",
            f"- expected batch (the public divisor): {_num(f['expected_batch'])} {f['sampled_unit']}s", ""]
    out += ["## Audit", ""]
    if f["audit"]:
        out += [", ".join(f"{k}: {_num(v) if isinstance(v, (int, float)) else v}" for k, v in f["audit"].items()),
                ""]
    else:
        out += ["No audit was run on this model. The mechanism is audited white-box by `userdp.audit_mechanism` "
                "(docs/privacy.md).", ""]
    code = f"userdp {f['userdp_version']}" + (f" (code {f['code_digest']})" if f["code_digest"] else "")
    libs = ", ".join(f"{k} {v}" for k, v in sorted(f["versions"].items()) if k not in ("userdp", "userdp_code"))
    out += ["## Code", "", f"Trained with {code}; {libs}. The full record is `ledger.json` beside this card.", ""]
    return "\n".join(out)


def write_card(folder: str | os.PathLike, ledger: Mapping[str, Any], *, title: str | None = None) -> Path:
    """Write README.md into `folder` (atomically) from `ledger`; its path."""
    from ..io import write_text

    path = Path(folder) / CARD
    write_text(path, render(ledger, title=title))
    return path


def _sampling_text(f: Mapping[str, Any]) -> str:
    """How units were sampled: Poisson, or cyclic Poisson over banded DP-FTRL's partitions."""
    cn = f.get("correlated_noise")
    if not cn:
        return (f"Poisson, each {f['sampled_unit']} included with probability {_num(f['sampling_rate'])} per step")
    return (f"cyclic Poisson: users split into {cn['bands']} partitions by a keyed hash; step t samples partition "
            f"t mod {cn['bands']}, each of its users with probability {_num(f['sampling_rate'])}")


def _correlated_text(cn: Mapping[str, Any] | None) -> str:
    """Banded DP-FTRL's noise: correlated across steps (userdp.privacy.banded)."""
    if not cn:
        return ""
    return (f", correlated across steps: DP-FTRL with {cn['bands']}-banded noise ({cn['strategy']}, column norm 1; "
            f"each user takes part in at most {cn['rounds_per_user']} steps, one per {cn['bands']})")


def _adaptive_text(adaptive: dict | None) -> str:
    """Adaptive clipping's line in the card: C_0 moved to its final value, toward which quantile, and the count."""
    if not adaptive:
        return ""
    return (f"; the initial C, moved to {_num(adaptive['clip_norm_final'])} toward the {_num(adaptive['quantile'])} "
            f"quantile of the units' norms through a noisy count (std {_num(adaptive['count_noise_std'])}), "
            f"accounted in the noise multiplier; the gradient's own multiplier is "
            f"{_num(adaptive['gradient_noise_multiplier'])}")
