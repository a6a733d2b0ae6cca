"""The settings of one fine-tuning run, and the one declaration of which of them change its result.

A run's result (its model, log and ledger) depends on its input files (plan,
tokens, tokenizer, base model), its wildcards (cell, learning rate) and:

- the training.* keys in RESULT_TRAINING_KEYS;
- the sequence length (the micro-batch width);
- the config seed (bounding and run seeds) and privacy.secret_seeds (where
  the sampling and noise randomness comes from);
- the model spec (targets.model_spec).

Everything derives from that list: rule finetune's `settings` param
(targets.finetune_params; the keys a run reads that change no result it
reads from the config with userdp.untracked), the checkpoint fingerprint of a run
(`TrainSettings.result_settings`, plus the seeds and digests of the base
model and the pool in run_state.run_fingerprint), and TrainSettings' fields.

Left out on purpose (changing them reruns nothing and resumes a checkpoint):
threads, gpus (data-parallel ranks give the one-process result up to float
summation order), physical_batch_size (micro-batching sums the same clipped
per-unit gradients, only in another order; the ledger still records the
value the run used), checkpoint_every (a resumed run continues the same RNG
streams), log_every_s, max_noise_buffers_gb (a memory bound: a run fits or stops
before its first step), gradient_checkpointing (recomputed activations give the
same clipped sums: tests/test_lora.py), learning_rates (the rate is the {lr} wildcard),
debug_step_log (an exception: it changes which train-log columns are
written, not the model, so it is not in the fingerprint and a checkpoint
resumes across it, but rule finetune carries it when on, so switching it
reruns the runs: targets.finetune_params).
device IS kept: the noise is drawn from a generator on that device and the
CPU and CUDA generators give different streams, so a run on another device
is another draw of the mechanism, not the same result with other rounding.

Torch-free: the Snakefile imports it (through targets) when it parses rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

# training.* keys that change a fine-tuning run's result (see the module docstring).
RESULT_TRAINING_KEYS = ("optimizer", "schedule", "warmup_steps", "precision", "uls_examples_per_user", "device")
# training.* keys a run reads (TrainSettings.from_config) that change no result (see the module docstring).
EXECUTION_TRAINING_KEYS = ("physical_batch_size", "checkpoint_every", "gradient_checkpointing", "max_noise_buffers_gb")


@dataclass
class TrainSettings:
    """The training.* settings of one run (plus the swept learning rate and the sequence length)."""

    learning_rate: float
    optimizer: str = "adam"
    schedule: str = "constant"
    warmup_steps: int = 0
    physical_batch_size: int = 64
    sequence_length: int = 64
    checkpoint_every: int = 25
    device: str = "auto"
    precision: str = "fp32"
    uls_examples_per_user: int | None = None
    log_every_s: float = 10.0
    debug_step_log: bool = False  # training.debug_step_log: which train-log columns are written (step_log)
    gradient_checkpointing: bool = False  # training.gradient_checkpointing: memory only, the same clipped sums
    max_noise_buffers_gb: float = 8.0  # training.max_noise_buffers_gb: banded DP-FTRL's buffers must fit in it

    @classmethod
    def from_config(cls, config: dict, learning_rate: float) -> "TrainSettings":
        tr = config["training"]
        return cls(
            learning_rate=float(learning_rate),
            optimizer=tr["optimizer"],
            schedule=tr["schedule"],
            warmup_steps=int(tr["warmup_steps"]),
            physical_batch_size=int(tr["physical_batch_size"]),
            sequence_length=int(config["tokenizer"]["sequence_length"]),
            checkpoint_every=int(tr["checkpoint_every"]),
            device=tr["device"],
            precision=tr["precision"],
            uls_examples_per_user=tr.get("uls_examples_per_user"),
            debug_step_log=bool(tr.get("debug_step_log", False)),
            gradient_checkpointing=bool(tr.get("gradient_checkpointing", False)),
            max_noise_buffers_gb=float(tr.get("max_noise_buffers_gb", 8.0)),
        )

    def result_settings(self, device: str | None = None) -> dict[str, Any]:
        """The settings that change this run's result: the learning rate, RESULT_TRAINING_KEYS, the sequence length.

        device: the device type the run actually uses (e.g. "cuda" for
        training.device auto on a GPU node); default the configured value.
        A checkpoint made on one device must not resume on another.
        """
        out: dict[str, Any] = {k: getattr(self, k) for k in RESULT_TRAINING_KEYS}
        if device is not None:
            out["device"] = str(device)
        out["learning_rate"] = self.learning_rate
        out["sequence_length"] = self.sequence_length
        return out


def check_uls_fits(group_size: int, physical_batch_size: int, examples_per_user: int | None, *,
                   key: str = "privacy.group_size.uls", smaller: str = "a smaller G (privacy.group_size.uls)",
                   source: str | None = None) -> None:
    """ULS micro-batches hold whole users: the largest user's rows of a step must fit in one.

    Used at config validation (explicit G) and by the training engine (any G).
    """
    largest = group_size if examples_per_user is None else min(group_size, examples_per_user)
    if largest > physical_batch_size:
        raise ConfigError(
            (f"{source}: " if source else "")
            + f"training.physical_batch_size is {physical_batch_size} but ULS needs whole users in one micro-batch "
            f"and a user can have up to {largest} examples per step (G = {group_size} from {key}"
            + ("" if examples_per_user is None else f", training.uls_examples_per_user = {examples_per_user}")
            + f"). Fix: set training.physical_batch_size >= {largest}, or {smaller}, "
            "or training.uls_examples_per_user <= training.physical_batch_size."
        )
