"""`userdp.UserDPSFTTrainer`: TRL's `SFTTrainer` with user-level DP training steps.

    from peft import LoraConfig
    from trl import SFTConfig
    trainer = userdp.UserDPSFTTrainer(
        model="path/to/chat-model", args=SFTConfig(output_dir="out/sft", learning_rate=1e-3, max_steps=20,
                                                   max_grad_norm=0, max_length=512),
        train_dataset=chats, eval_dataset=held_out, processing_class=tok, peft_config=LoraConfig(r=16),
        privacy=userdp.PrivacyArguments(method="uls", epsilon=4.0, compute=2000, user_column="author"))
    trainer.train(); trainer.evaluate(); trainer.save_model()

It is `UserDPTrainer` (userdp/trainer.py) on top of TRL's `SFTTrainer` (trl 1.16): SFTTrainer loads a model
given by name, wraps it with `peft_config`, takes an `SFTConfig` and reports its evaluation metrics
(`eval_loss`, `eval_mean_token_accuracy`, `eval_entropy`); every training step is userdp's DP step. What
changes against a plain SFTTrainer, and why:

- The rows are framed by userdp, not by SFTTrainer's dataset preparation (it is skipped: `dataset_kwargs=
  {"skip_prepare_dataset": True}` on a copy of the SFTConfig). A `messages` column (TRL's conversational
  format) is framed with the tokenizer's chat template and the loss is on the assistant's tokens only, found
  by rendering prefixes, so no `{% generation %}` markers are needed; `prompt` and `completion` columns
  train on the completion only; otherwise the text column is `SFTConfig.dataset_text_field`. The columns are
  detected as TRL detects them unless `PrivacyArguments` names them. `SFTConfig.max_length` is the sequence
  length (rows are cut, never packed).
- Refused, each with a ConfigError naming the SFTConfig field: `packing` (a packed sequence holds examples
  of several users: no per-user gradient exists to clip), `padding_free` (rows flattened into one sequence:
  the same), `completion_only_loss=False` on prompt/completion rows (userdp trains on the completion only),
  settings of SFTTrainer's own loss that the DP step would not apply (`loss_type` other than nll,
  `label_smoothing_factor`, `compute_loss_func`, `activation_offloading`, `truncation_mode="keep_end"`,
  `eval_packing`), and everything UserDPTrainer refuses (max_grad_norm > 0, gradient accumulation, several processes, fp16,
  max_steps unset). For conversations the loss is on the assistant's tokens whatever
  `assistant_only_loss` says (TRL's default, False, trains on the whole sequence; userdp's contract is the
  answers only); it is logged.
- SFTTrainer's own model card (written at every checkpoint) is replaced by userdp's, which `save_model`
  renders from the ledger: a card that says nothing of the guarantee is never written.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from trl import SFTConfig, SFTTrainer

from .arguments import PrivacyArguments, TrainingOptions
from .errors import ConfigError
from .trainer import UserDPTrainer

log = logging.getLogger("userdp.sft_trainer")


class UserDPSFTTrainer(UserDPTrainer, SFTTrainer):
    """TRL's SFTTrainer whose every training step is a user-level DP step of `privacy` (see the module doc).

    model: a model or its name/folder (SFTTrainer loads it); args: an SFTConfig (or TrainingArguments);
    train_dataset / eval_dataset: rows of users (a datasets.Dataset, DataFrame or pyarrow Table) in TRL's
    formats (`messages`, `prompt` + `completion`, or text) plus the user column; peft_config: a peft config
    SFTTrainer wraps the model with. privacy, options, observe: as UserDPTrainer's.
    """

    _rows_to_parent = True

    def __init__(self, model: Any, args: Any = None, *, privacy: PrivacyArguments, train_dataset: Any = None,
                 options: TrainingOptions | None = None, **kwargs: Any) -> None:
        if not isinstance(privacy, PrivacyArguments):
            raise ConfigError(f"privacy is a {type(privacy).__name__}; give userdp.PrivacyArguments(...).")
        if train_dataset is None:
            raise ConfigError("train_dataset is missing: give the rows to train on (user and example columns).")
        if kwargs.get("compute_loss_func") is not None:
            raise ConfigError("compute_loss_func is given: UserDPSFTTrainer's DP step computes its own loss (the "
                              "mean next-token cross-entropy of each row's answer tokens); a custom loss would "
                              "act on evaluation only. Leave compute_loss_func unset.")
        args = _sft_config(args)
        rows = _as_dataset(train_dataset, "train_dataset")
        if kwargs.get("eval_dataset") is not None:
            kwargs["eval_dataset"] = _as_dataset(kwargs["eval_dataset"], "eval_dataset")
        privacy = _with_columns(privacy, rows.column_names, args)
        _check_losses(args, privacy)
        options = options or TrainingOptions()
        if options.sequence_length is None and args.max_length is not None:
            options = dataclasses.replace(options, sequence_length=int(args.max_length))
        super().__init__(model=model, args=args, train_dataset=rows, privacy=privacy, options=options, **kwargs)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """Nothing here: userdp's card (README.md, from the ledger) is written by `save_model`."""

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """SFTTrainer's evaluation of rows framed as the training rows (its own dataset preparation is skipped)."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = _as_dataset(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                metric_key_prefix=metric_key_prefix)


def _sft_config(args: Any) -> SFTConfig:
    """A copy of the SFTConfig (or TrainingArguments made one) with TRL's dataset preparation off; the
    settings that break the unit of privacy refused."""
    from transformers import TrainingArguments

    if args is None:
        raise ConfigError("args is missing: give an SFTConfig(output_dir=..., max_steps=T, max_grad_norm=0, ...).")
    if not isinstance(args, TrainingArguments):
        raise ConfigError(f"args is a {type(args).__name__}; give a trl.SFTConfig (or a TrainingArguments).")
    if not isinstance(args, SFTConfig):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
        args = SFTConfig(**values)
    if args.packing:
        raise ConfigError("SFTConfig.packing is True: a packed sequence holds examples of several users, so no "
                          "per-user (or per-example) gradient exists to clip. Set packing=False; userdp packs "
                          "whole rows into fixed-shape micro-batches itself (TrainingOptions.physical_batch_size).")
    if args.padding_free:
        raise ConfigError("SFTConfig.padding_free is True: the rows of a batch would be flattened into one "
                          "sequence, and DP clipping needs each row's own gradient. Set padding_free=False.")
    # Settings of SFTTrainer's own loss and batches: the DP step computes its loss itself (mean next-token
    # cross-entropy over each row's answer tokens), so these would train one objective and evaluate another.
    ignored = [(name, fix) for name, agrees, fix in (
        ("loss_type", args.loss_type == "nll", "'nll'"),
        ("label_smoothing_factor", not args.label_smoothing_factor, "0"),
        ("activation_offloading", not args.activation_offloading, "False"),
        ("truncation_mode", args.truncation_mode == "keep_start", "'keep_start'"),
        ("eval_packing", not args.eval_packing, "None or False"),
    ) if not agrees]
    if ignored:
        name, fix = ignored[0]
        value = getattr(args, name)
        raise ConfigError(f"SFTConfig.{name} is {value!r}: UserDPSFTTrainer's DP step computes its own loss (the "
                          "mean next-token cross-entropy of each row's answer tokens) on rows cut at max_length "
                          f"from the start, so this setting would not act on training. Set {name}={fix}.")
    kwargs = dict(args.dataset_kwargs or {})
    kwargs["skip_prepare_dataset"] = True
    return dataclasses.replace(args, dataset_kwargs=kwargs, assistant_only_loss=False)


def _as_dataset(rows: Any, name: str) -> Any:
    """Rows as a datasets.Dataset (SFTTrainer's contract); a DataFrame or pyarrow Table is converted."""
    import datasets

    if isinstance(rows, (datasets.Dataset, datasets.DatasetDict, dict)):
        return rows
    if hasattr(rows, "to_pandas") or hasattr(rows, "iloc"):
        frame = rows.to_pandas() if hasattr(rows, "to_pandas") else rows
        return datasets.Dataset.from_pandas(frame, preserve_index=False)
    raise ConfigError(f"{name} is a {type(rows).__name__}; give a datasets.Dataset, a pandas DataFrame or a pyarrow "
                      "Table of rows.")


def _with_columns(privacy: PrivacyArguments, columns: list[str], args: SFTConfig) -> PrivacyArguments:
    """`privacy` with the example columns TRL would read, when it names none: `messages` (conversations),
    `prompt` + `completion`, else SFTConfig.dataset_text_field."""
    from .data.chat import COLUMN_KEYS

    if any(getattr(privacy, k) is not None for k in COLUMN_KEYS):
        return privacy
    if "messages" in columns:
        return dataclasses.replace(privacy, messages_column="messages")
    if "prompt" in columns and "completion" in columns:
        return dataclasses.replace(privacy, prompt_column="prompt", completion_column="completion")
    return dataclasses.replace(privacy, text_column=args.dataset_text_field or "text")


def _check_losses(args: SFTConfig, privacy: PrivacyArguments) -> None:
    kind = privacy.framing().kind
    if kind == "prompt_completion" and args.completion_only_loss is False:
        raise ConfigError("SFTConfig.completion_only_loss is False, but UserDPSFTTrainer trains prompt/completion "
                          "rows on the completion only (userdp's instruction framing). Leave completion_only_loss "
                          "unset (or True), or give the rows as text (PrivacyArguments.text_column) to train on "
                          "every token.")
    if kind == "messages":
        log.info("conversations are framed with the chat template; the loss is on the assistant's tokens only "
                 "(whatever SFTConfig.assistant_only_loss says)")
