"""`userdp.UserDPTrainer`: a Hugging Face `transformers.Trainer` whose training steps are user-level DP steps.

    trainer = userdp.UserDPTrainer(
        model=model, args=TrainingArguments(output_dir="out/trainer", learning_rate=1e-3, max_steps=20,
                                            max_grad_norm=0, save_steps=10, logging_steps=5),
        train_dataset=rows, eval_dataset=held_out, processing_class=tok,
        privacy=userdp.PrivacyArguments(method="els", epsilon=4.0, compute=2000, user_column="author",
                                        text_column="body"))
    trainer.train()                   # T = max_steps noisy steps; loss and epsilon in Trainer's logs
    trainer.evaluate()                # eval_loss on held-out users' rows
    trainer.save_model()              # the model (adapter), ledger.json, README.md model card, plan.json

How it maps onto Trainer (transformers 5.24):

- The plan is made when the trainer is built: the rows of `train_dataset` (a datasets.Dataset, a pandas
  DataFrame or a pyarrow Table of (user, text), (user, messages) or (user, prompt, completion) rows) are
  framed as `fine_tune` frames them (chat: the tokenizer's chat template, the loss on the assistant's
  messages) and bounded to G;
  `userdp.plan` calibrates the noise for T = `args.max_steps` steps; `trainer.spec` is the RunSpec.
- The training data loader yields T step tickets, one per noisy step; the step itself (in `training_step`)
  draws that step's Poisson sample of users (ULS) or bounded examples (ELS) from the engine's keyed sampler,
  packs it, clips per unit, adds the noise once and divides by the public expected batch: p.grad holds the
  privatised update when Trainer's loop calls `optimizer.step()` and `lr_scheduler.step()`. The sample is
  drawn in the step, not by the loader, because accelerate's loader prefetches one batch ahead: a sample
  drawn there would belong to the next step when a checkpoint is written. After the optimizer step
  (`on_optimizer_step`) the step is counted and logged as the engine counts it: the core is
  `training.private.PrivateTraining`, the object `make_private` returns, and its step is the engine's.
- Refused at construction, each with a ConfigError naming the TrainingArguments field: `max_steps` unset
  (T must be known to plan), `max_grad_norm` > 0 (a second clipping of the noisy update: transformers'
  default 1.0 must be set to 0), `gradient_accumulation_steps` > 1 (several DP steps summed into one update
  is another mechanism than the accountant's), several processes or GPUs (the engine's data parallelism
  is the pipeline's torchrun path), fp16.
- Logs: Trainer's `loss` (the mean loss of the sampled rows: a noise-free statistic of the sampled users,
  outside the guarantee, like `StepStats.loss`) and `epsilon`, the guarantee of the steps taken so far.
- Checkpoints: Trainer's, plus `userdp_state.pt` (mode 0600) holding the sampler's and the noise
  generator's secret state, the counters and the step log; `train(resume_from_checkpoint=...)` continues
  those streams (the resumed run samples and noises exactly as an uninterrupted one), and when the T-th step
  is done every `userdp_state.pt` under output_dir is deleted, so a released model's randomness cannot be
  re-used or read back.
- `save_model(folder)` writes Trainer's model files and, beside them, ledger.json, train_log.parquet,
  plan.json and the README.md model card; `userdp.load_released` and `userdp.read_ledger` read the folder.

TRL's SFTTrainer is not wrapped: see docs/api.md, "TRL's SFTTrainer".
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import Trainer, TrainerCallback

from .arguments import PrivacyArguments, TrainingOptions, privacy_section
from .errors import ConfigError, DataError

log = logging.getLogger("userdp.trainer")

#: The secret state file in each of Trainer's checkpoint folders.
STATE_FILE = "userdp_state.pt"


class _CountSteps(TrainerCallback):
    """After Trainer's optimizer step: count and log the DP step (the engine's `Run.complete`)."""

    def __init__(self, trainer: "UserDPTrainer") -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.complete_dp_step()


def check_arguments(args: Any) -> None:
    """ConfigError for TrainingArguments that would change the mechanism the accountant assumes."""
    if not args.max_steps or args.max_steps < 1:
        raise ConfigError("TrainingArguments.max_steps is not set: UserDPTrainer plans T = max_steps noisy steps "
                          "before training (num_train_epochs has no meaning for Poisson sampling); set "
                          "max_steps=T.")
    if args.max_grad_norm and args.max_grad_norm > 0:
        raise ConfigError(f"TrainingArguments.max_grad_norm is {args.max_grad_norm} (transformers' default is 1.0): "
                          "Trainer would clip the noisy update a second time, after the DP step's per-unit "
                          "clipping (PrivacyArguments.clip_norm). Set max_grad_norm=0.")
    if args.gradient_accumulation_steps != 1:
        raise ConfigError(f"TrainingArguments.gradient_accumulation_steps is {args.gradient_accumulation_steps}: "
                          "each noisy step is one update (the micro-batching inside a step is "
                          "TrainingOptions.physical_batch_size); summing several DP steps into one update is "
                          "not the mechanism the accountant assumes. Set gradient_accumulation_steps=1.")
    if args.world_size > 1 or args.n_gpu > 1:
        raise ConfigError(f"UserDPTrainer runs in one process on one device (world size {args.world_size}, "
                          f"{args.n_gpu} GPUs); for data-parallel DP training use the pipeline (training.gpus, "
                          "torchrun), whose ranks share one sample and one noise draw.")
    if args.fp16:
        raise ConfigError("TrainingArguments.fp16 is set; DP clipping supports fp32 and bf16 autocast: set bf16=True "
                          "(on CUDA) or neither.")


class UserDPTrainer(Trainer):
    """A transformers.Trainer whose every training step is a user-level DP step of `privacy` (see the module doc).

    privacy: PrivacyArguments (method, epsilon, compute, user_column, text_column or messages_column or
    prompt_column + completion_column, ...). options:
    TrainingOptions (sequence_length, physical_batch_size, ...; the device is Trainer's). observe: the engine's
    observation hook (tests and audits). Other arguments are Trainer's; `processing_class` (the tokenizer) is
    required.
    """

    #: Whether the parent class's __init__ takes train_dataset (UserDPSFTTrainer's SFTTrainer does).
    _rows_to_parent = False

    def __init__(self, *args: Any, privacy: PrivacyArguments, options: TrainingOptions | None = None,
                 observe: Callable[[Any], None] | None = None, **kwargs: Any) -> None:
        if not isinstance(privacy, PrivacyArguments):
            raise ConfigError(f"privacy is a {type(privacy).__name__}; give userdp.PrivacyArguments(...).")
        rows = kwargs.pop("train_dataset", None)
        if rows is None:
            raise ConfigError("train_dataset is missing: give the rows to train on (user and example columns).")
        if self._rows_to_parent:  # a parent Trainer that must see the rows (TRL's SFTTrainer; it leaves them as they are)
            kwargs["train_dataset"] = rows
        super().__init__(*args, **kwargs)
        check_arguments(self.args)
        if self.processing_class is None:
            raise ConfigError("processing_class is missing: give the model's tokenizer.")
        self.privacy, self._observe = privacy, observe
        self._options = dataclasses.replace(options or TrainingOptions(), device=self.args.device.type,
                                            precision="bf16" if self.args.bf16 else None)
        self._prepare(rows)
        # T step tickets, one per noisy step: the step's number (the sample is drawn in the step, see the module doc)
        self.train_dataset = [{"userdp_step": torch.tensor(i)} for i in range(self.spec.steps)]
        self._dp: Any = None
        self._resume: str | None = None
        self._pending: tuple | None = None
        self.add_callback(_CountSteps(self))

    # ------------------------------------------------------------------ the plan and the pool
    def _prepare(self, rows: Any) -> None:
        """The plan of T = max_steps steps and the G-bounded pool of the rows (make_private's preparation)."""
        from .private_training import prepare_rows

        p = self.privacy
        self._config = self._options.config(privacy=privacy_section(p), seed=p.seed)
        self._tok, self.spec, self._pool = prepare_rows(rows, p, self.processing_class, self.model, self._config,
                                                        steps=int(self.args.max_steps))
        self._length = int(self._config["tokenizer"]["sequence_length"])

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """T step tickets, in order (no shuffling, no workers): the sample is the DP step's (module doc)."""
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=1, shuffle=False)

    # ------------------------------------------------------------------ the DP core
    def _core(self) -> Any:
        """The PrivateTraining of this trainer, built at the first step (Trainer's optimizer exists then)."""
        if self._dp is not None:
            return self._dp
        from .private_training import run_settings
        from .training.models import special_ids
        from .training.private import PrivateTraining

        args = self.args
        settings, seeds = run_settings(self._config, self.spec, self.privacy, float(args.learning_rate),
                                       f"{getattr(args.optim, 'value', args.optim)} (Trainer's)",
                                       f"{getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)} (Trainer's)")
        self._dp = PrivateTraining(self.model, self.optimizer, self._pool, self.spec, settings, seeds,
                                   special_ids(self._tok)["pad_token_id"], observe=self._observe)
        if self._resume is not None:
            self._load_state(Path(self._resume))
        return self._dp

    def _state_key(self) -> dict[str, Any]:
        """What a checkpoint's DP state must match: the mechanism and the bounded pool."""
        from .training import checkpoint as ckpt
        from .training.run_state import fingerprint_plan

        return {"plan": fingerprint_plan(self.spec), "pool": ckpt.arrays_digest(*self._pool.content_arrays())}

    def _load_state(self, folder: Path) -> None:
        """Resume the DP state from `folder`'s STATE_FILE (`train` refused a checkpoint without one)."""
        path = folder / STATE_FILE
        saved = torch.load(path, weights_only=True)
        if saved.get("key") != self._state_key():
            raise DataError(f"{path} belongs to another plan or other training rows (the mechanism or the bounded "
                            "pool differ); resume with the same PrivacyArguments, max_steps and train_dataset.")
        self._dp.load_state_dict(saved["state"])
        log.info("resumed the DP state at step %d/%d from %s", self._dp.steps_done, self.spec.steps, path)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        """The DP step's gradient: sample, clip per unit, noise once, divide (p.grad = the privatised update);
        the step is counted after Trainer's optimizer step (`_CountSteps`)."""
        dp = self._core()
        dp.check()
        ticket = int(inputs["userdp_step"].reshape(-1)[0])
        if ticket != dp.steps_done:
            raise RuntimeError(f"Trainer is at step {ticket} but the DP state at step {dp.steps_done}: resume from a "
                               "checkpoint with its userdp_state.pt.")
        model.train()
        self._pending = dp.engine_run.privatize()
        sums = self._pending.sums
        return torch.tensor(sums.loss_sum / sums.n_rows if sums.n_rows else float("nan"), device=self.args.device)

    def complete_dp_step(self) -> None:
        if self._pending is None:  # pragma: no cover - Trainer steps the optimizer only after a training_step
            raise RuntimeError("an optimizer step without a DP step")
        pending, self._pending = self._pending, None
        self._dp.engine_run.complete(pending)

    # ------------------------------------------------------------------ logs, checkpoints, release
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._dp is not None and "loss" in logs:
            logs["epsilon"] = self._dp.epsilon
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        from transformers.trainer_utils import get_last_checkpoint

        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise DataError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint-*; "
                                "train from the start.")
        self._resume = None if not resume_from_checkpoint else str(resume_from_checkpoint)
        if self._resume is not None and not (Path(self._resume) / STATE_FILE).is_file():
            self._dp = None
            raise DataError(f"{self._resume} holds no {STATE_FILE}: nothing to resume the DP sampling and noise "
                            "from (a finished run deletes it, so its randomness is never re-used). Train from the "
                            "start.")
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        if self._dp is not None and self._dp.steps_done >= self.spec.steps:
            self._forget_states()
        return output

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from .training import checkpoint as ckpt

        super()._save_checkpoint(model, trial)
        if self._dp is None or not self.args.should_save:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        ckpt.save_checkpoint(folder, {"key": self._state_key(), "state": self._dp.state_dict()}, name=STATE_FILE)

    def _forget_states(self) -> None:
        """Delete the secret DP state of every checkpoint of this run (the run is complete)."""
        removed = 0
        for path in Path(self.args.output_dir).glob(f"*/{STATE_FILE}"):
            path.unlink(missing_ok=True)
            removed += 1
        if removed:
            log.info("deleted the secret DP state of %d checkpoint(s) in %s", removed, self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's model files and, for a release (not a checkpoint), ledger.json, train_log.parquet, plan.json
        and the README.md model card beside them."""
        super().save_model(output_dir, _internal_call)
        if _internal_call or self._dp is None or not self.args.should_save:
            return
        from .layout import PLAN_FILE
        from .training import engine

        folder = Path(output_dir or self.args.output_dir)
        engine.write_records(self._dp.engine_run, folder)
        self.spec.write(folder / PLAN_FILE)

    # ------------------------------------------------------------------ evaluation
    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """Held-out users' rows framed as the training rows (text: bos + text + eos; chat and instruction
        rows by their framing), cut to the sequence length, with labels on the tokens the training loss is
        on (every token, or the answers); datasets already tokenized go to Trainer as they are."""
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(data, str):
            data = self.eval_dataset[data]
        names = getattr(data, "column_names", None)
        columns = list(names if names is not None else getattr(data, "columns", []))
        if not set(self.privacy.framing().columns) <= set(columns):
            return super().get_eval_dataloader(eval_dataset)
        return super().get_eval_dataloader(self._framed(data))

    def _framed(self, data: Any) -> Any:
        import datasets

        from .api import _rows, _tokens_table
        from .data.chat import loss_masks
        from .training.models import special_ids

        framing = self.privacy.framing()
        users, examples = _rows(data, self.privacy.user_column, framing)
        table = _tokens_table(self._tok, users, examples, self._length, framing.kind)
        pad = special_ids(self._tok)["pad_token_id"]
        masks = loss_masks(table)
        ids, mask, labels = [], [], []
        for i, row in enumerate(table.column("input_ids").to_pylist()):
            n = len(row)
            target = row if masks is None else [t if m else -100 for t, m in zip(row, masks[i])]
            ids.append(row + [pad] * (self._length - n))
            mask.append([1] * n + [0] * (self._length - n))
            labels.append(target + [-100] * (self._length - n))
        return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": mask, "labels": labels})
