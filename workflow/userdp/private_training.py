"""`userdp.make_private`: user-level DP training of your own model, optimizer and loop.

    import torch, userdp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained("path/to/checkpoint")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained("path/to/checkpoint"), LoraConfig(r=8, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    dp = userdp.make_private(model, optimizer, data=rows, user_column="author", text_column="body", tokenizer=tok,
                             method="uls", epsilon=4.0, compute=2000, steps=20)
    for _ in range(dp.spec.steps):
        stats = dp.step()          # one noisy step: Poisson sample, clip per unit, noise once, optimizer.step()
    print(dp.epsilon, dp.spec.noise_multiplier, dp.spec.group_size, stats.loss)
    dp.save("out/own-loop")        # the released model (adapter), ledger.json, README.md model card

`make_private` frames the rows as `userdp.fine_tune` does (bos + text + eos, cut to the sequence length; chat
rows with the tokenizer's chat template and prompt/completion pairs with the loss on the answers only),
plans the mechanism with the pipeline's planner and rules (`userdp.plan`: G by the method's rule, the
sampling rate that spends `compute` examples in `steps` steps, the noise multiplier calibrated to epsilon),
bounds every user to G examples, and returns a `training.private.PrivateTraining` around the engine's own
step. Or give `spec=` (a RunSpec from `userdp.plan`) to train a plan made before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .arguments import PrivacyArguments, TrainingOptions, check_target, privacy_section
from .data.chat import COLUMN_KEYS
from .errors import ConfigError
from .privacy.spec import RunSpec


def make_private(model: Any, optimizer: Any, *, data: Any, tokenizer: Any, user_column: str | None = None,
                 text_column: str | None = None, method: str | None = None, epsilon: float | None = None,
                 compute: int | None = None, steps: int | None = None, privacy: PrivacyArguments | None = None,
                 spec: RunSpec | None = None, options: TrainingOptions | None = None, scheduler: Any = None,
                 delta: float | None = None, group_size: int | None = None, clip_norm: float | None = None,
                 secret_seeds: bool = True, seed: int = 0, messages_column: str | None = None,
                 prompt_column: str | None = None, completion_column: str | None = None,
                 observe: Callable[[Any], None] | None = None) -> Any:
    """User-level DP training of `model` (an nn.Module causal LM, a PeftModel too) with `optimizer` on `data`.

    data: a pandas DataFrame, a pyarrow Table or a datasets.Dataset, one row per example; every user is a train
    user; text_column holds its text, or messages_column a conversation (a list of {"role", "content"} dicts,
    framed with the tokenizer's chat template; the loss, and so every clipped gradient, on the assistant's
    messages only), or prompt_column and completion_column an instruction pair (the loss on the completion).
    tokenizer: the model's tokenizer (an object, or a folder / hub id). The mechanism: method ("els" or
    "uls"), epsilon (math.inf: the non-private reference), compute (examples processed in expectation, K), steps
    (T), and optionally delta, group_size, clip_norm, secret_seeds, seed; or all of them as `privacy`
    (PrivacyArguments, with the data's columns) and steps; or a calibrated `spec` (userdp.plan) instead of the
    target. options: TrainingOptions (sequence length, physical batch, device, precision, ...). scheduler: a
    learning-rate scheduler of `optimizer`, stepped after each optimizer step (or step it yourself). observe: the
    engine's observation hook (tests and audits). Returns a PrivateTraining: `step()`, `epsilon`, `spec`,
    `save(folder)`, `ledger()`.
    """
    from .training.models import special_ids
    from .training.private import PrivateTraining

    given = dict(user_column=user_column, text_column=text_column, messages_column=messages_column,
                 prompt_column=prompt_column, completion_column=completion_column)
    columns = {k: v for k, v in given.items() if v is not None}
    args = _privacy_arguments(privacy, method, epsilon, compute, columns, delta, group_size, clip_norm,
                              secret_seeds, seed, spec)
    if spec is None:
        if steps is None:
            raise ConfigError("steps is missing: give the number of noisy steps T (or a calibrated spec=).")
        check_target(args.method, args.epsilon, args.compute, steps)
    options = options or TrainingOptions()
    if options.device is None:
        options = _with_model_device(options, model)
    cfg = options.config(privacy=privacy_section(args), seed=args.seed)
    tok, spec, pool = prepare_rows(data, args, tokenizer, model, cfg, steps=steps, spec=spec)
    lr = float(optimizer.param_groups[0]["lr"]) if hasattr(optimizer, "param_groups") else 0.0
    settings, seeds = run_settings(cfg, spec, args, lr, f"{type(optimizer).__name__} (the caller's)",
                                   "the caller's" if scheduler is not None else "constant")
    return PrivateTraining(model, optimizer, pool, spec, settings, seeds, special_ids(tok)["pad_token_id"],
                           scheduler=scheduler, observe=observe)


def prepare_rows(data: Any, args: PrivacyArguments, tokenizer: Any, model: Any, cfg: dict, *,
                 steps: int | None = None, spec: RunSpec | None = None) -> tuple[Any, RunSpec, Any]:
    """(tokenizer, spec, pool) of (user, text) rows for `model` (make_private's and UserDPTrainer's): the rows
    checked and framed as `fine_tune` frames them, the mechanism planned for `steps` steps (or `spec` as given),
    every user bounded to G (`api._prepare`)."""
    from .api import _prepare

    planned = None if spec is None else RunSpec.from_record(spec).steps
    if planned is not None and steps is not None and int(steps) != planned:  # before any row is tokenized
        raise ConfigError(f"steps is {steps} but the spec plans {planned}; give one of them.")
    return _prepare(data, args.user_column, args.framing(), tokenizer, cfg, args.method, args.epsilon, args.compute,
                    steps, args.group_size, model=model, spec=spec)


def run_settings(cfg: dict, spec: RunSpec, args: PrivacyArguments, learning_rate: float, optimizer: str,
                 schedule: str) -> tuple[Any, dict[str, Any]]:
    """(TrainSettings, seeds) of a run of `spec` with the caller's optimizer and schedule (named for the ledger);
    the seeds are the engine's run seeds, secret unless args.secret_seeds is False."""
    from .config import API_DATASET
    from .layout import fmt_num
    from .training import run_seeds
    from .training.settings import TrainSettings

    settings = TrainSettings.from_config(cfg, float(learning_rate))
    settings.optimizer, settings.schedule = optimizer, schedule
    seeds = run_seeds.run_seeds(args.seed, 0, API_DATASET, spec.method, fmt_num(spec.epsilon), spec.compute_budget or 0,
                             spec.group_size, float(learning_rate), secret=args.secret_seeds)
    return settings, seeds


def _privacy_arguments(privacy: PrivacyArguments | None, method, epsilon, compute, columns: dict[str, str],
                       delta, group_size, clip_norm, secret_seeds, seed, spec) -> PrivacyArguments:
    """The PrivacyArguments of make_private's keywords (or `privacy` itself; a spec stands for the target)."""
    given = {k: v for k, v in (("method", method), ("epsilon", epsilon), ("compute", compute), ("delta", delta),
                                ("group_size", group_size), ("clip_norm", clip_norm)) if v is not None}
    if privacy is not None:
        if not isinstance(privacy, PrivacyArguments):
            raise ConfigError(f"privacy is a {type(privacy).__name__}; give userdp.PrivacyArguments(...).")
        if given:
            raise ConfigError(f"{sorted(given)} given both as keywords and in privacy=PrivacyArguments(...); give "
                              "each once.")
        if set(columns) - {"user_column"}:  # the example columns given here replace the arguments' kind
            privacy = dataclasses.replace(privacy, **dict.fromkeys(COLUMN_KEYS))
        return dataclasses.replace(privacy, **columns)
    if spec is not None:
        spec = RunSpec.from_record(spec)
        clash = sorted(set(given) - {"clip_norm"})
        if clash:
            raise ConfigError(f"{clash} given with spec=: the spec holds the mechanism; give one of them.")
        given = {"method": spec.method, "epsilon": spec.epsilon, "compute": spec.compute_budget or 1}
    missing = [k for k in ("method", "epsilon", "compute") if k not in given]
    if missing:
        raise ConfigError(f"{missing} missing: give method=, epsilon=, compute= and steps= (or privacy= with "
                          "steps=, or a calibrated spec=).")
    return PrivacyArguments(**{"user_column": "user_id", **columns}, secret_seeds=secret_seeds, seed=seed,
                            **given)


def _with_model_device(options: TrainingOptions, model: Any) -> TrainingOptions:
    """`options` with the device the model is on (make_private trains it where the caller put it)."""
    try:
        device = next(model.parameters()).device.type
    except (AttributeError, StopIteration):
        raise ConfigError(f"model is a {type(model).__name__} without parameters; give a torch nn.Module causal "
                          "LM (AutoModelForCausalLM, or a PeftModel of one).") from None
    return dataclasses.replace(options, device=device if device in ("cpu", "cuda") else "auto")
