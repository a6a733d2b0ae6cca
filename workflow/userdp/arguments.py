"""Typed settings of the public entry points: `PrivacyArguments` (the mechanism's target and the data's
columns) and `TrainingOptions` (how the steps execute), validated by the config schema.

They are what `userdp.make_private` and `userdp.UserDPTrainer` take instead of dicts of config keys. Each
field maps to one key of the config schema (workflow/schemas/config.schema.yaml), so its bounds and defaults
are the pipeline's, and a bad value is a ConfigError that names the argument (`TrainingOptions.device`,
`PrivacyArguments.clip_norm`), not the config key.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any

from .errors import ConfigError
from .privacy.mechanism import METHODS


@dataclasses.dataclass(frozen=True)
class PrivacyArguments:
    """The user-level DP target of a run and where its users are.

    method: "els" or "uls". epsilon: the released model's target (math.inf: the non-private reference, no
    noise). compute: examples processed in expectation over the run (K). user_column / text_column: the data's
    user id and text (default "text"); or messages_column (chat: a list of {"role", "content"} dicts per row,
    framed with the tokenizer's chat template, the loss on the assistant's messages only), or prompt_column with
    completion_column (the loss on the completion only). delta: default 1 / N^1.1 for N users.
    group_size: the contribution bound G (default: the method's rule, median for ELS, snr for ULS).
    clip_norm, clipping: privacy.clip_norm (default 1.0) and privacy.clipping ("flat", "normalized" or
    "adaptive"); adaptive: privacy.adaptive (quantile, learning_rate, count_noise) for adaptive clipping.
    correlated_noise: privacy.correlated_noise (e.g. {"bands": 4}): ULS as user-level DP-FTRL with banded noise.
    secret_seeds: True (the default for user data): the sampling and noise randomness is fresh OS entropy,
    never written; False derives it from `seed` (reproducible; the guarantee then does not hold against
    whoever has the seed).
    """

    method: str
    epsilon: float
    compute: int
    user_column: str = "user_id"
    text_column: str | None = None
    delta: float | None = None
    group_size: int | None = None
    clip_norm: float | None = None
    clipping: str | None = None
    adaptive: dict | None = None
    correlated_noise: dict | None = None
    secret_seeds: bool = True
    seed: int = 0
    messages_column: str | None = None
    prompt_column: str | None = None
    completion_column: str | None = None

    def framing(self) -> Any:
        """The data's kind of example and its columns (`data.chat.Framing`); plain text in "text" by default."""
        from .data.chat import COLUMN_KEYS, Framing

        return Framing.of(owner="PrivacyArguments.", default_text="text", **{k: getattr(self, k) for k in COLUMN_KEYS})

    def __post_init__(self) -> None:
        check_target(self.method, self.epsilon, self.compute, 1)
        check_group_size(self.group_size, "PrivacyArguments.")
        if not isinstance(self.user_column, str) or not self.user_column:
            raise ConfigError(f"PrivacyArguments.user_column is {self.user_column!r}; give the column's name.")
        self.framing()
        if not isinstance(self.secret_seeds, bool):
            raise ConfigError(f"PrivacyArguments.secret_seeds is {self.secret_seeds!r}; give True or False.")
        privacy_section(self)  # the schema's checks of delta, clip_norm, clipping, adaptive, correlated_noise
        if self.correlated_noise is not None and self.method != "uls":
            raise ConfigError(f"PrivacyArguments.correlated_noise is set with method {self.method!r}: banded DP-FTRL "
                              "runs with user-level sampling only; use method='uls' or correlated_noise=None.")


def privacy_section(args: PrivacyArguments) -> dict[str, Any]:
    """The privacy.* keys of `args`, validated by the schema (messages name PrivacyArguments' fields)."""
    from .config import run_config

    section = {k: getattr(args, k) for k in ("delta", "clip_norm", "clipping", "adaptive", "correlated_noise")
               if getattr(args, k) is not None}
    return _named(lambda: run_config(privacy=section, source="PrivacyArguments")["privacy"], "privacy",
                  "PrivacyArguments", section)


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """How the noisy steps execute; none of them changes the mechanism the accountant assumes.

    sequence_length: tokens per row (texts are cut; default tokenizer.sequence_length, 64). physical_batch_size:
    rows per micro-batch, a memory bound (default training.physical_batch_size, 64; for ULS at least G).
    device: "cpu", "cuda" or "auto" (default: where the model is). precision: "fp32" or "bf16" (bf16 autocast on
    CUDA). uls_examples_per_user: ULS uses a random k of each sampled user's examples per step (None: all).
    gradient_checkpointing: recompute activations (memory; the same clipped sums). debug_step_log: also write the
    noise-free per-step columns (batch loss, realised sizes) to train_log.parquet: outside the guarantee.
    """

    sequence_length: int | None = None
    physical_batch_size: int | None = None
    device: str | None = None
    precision: str | None = None
    uls_examples_per_user: int | None = None
    gradient_checkpointing: bool | None = None
    debug_step_log: bool | None = None

    def __post_init__(self) -> None:
        self.config()

    def config(self, **sections: Any) -> dict:
        """A validated run config with these options (and `sections`, e.g. privacy=...) over the defaults: every
        field but sequence_length (tokenizer.sequence_length) is the training.* key of its name."""
        from .config import run_config

        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        training = {k: v for k, v in given.items() if k != "sequence_length"}
        return _named(lambda: run_config(training=training, sequence_length=self.sequence_length,
                                         source="TrainingOptions", **sections), "training", "TrainingOptions",
                      given, extra={"tokenizer.sequence_length": "sequence_length"})


def _named(build, prefix: str, owner: str, given: dict[str, Any], extra: dict[str, str] | None = None) -> Any:
    """build(), with a schema ConfigError about key `prefix.X` (X a given field) re-worded to name `owner.X`."""
    try:
        return build()
    except ConfigError as exc:
        text = str(exc)
        keys = {f"{prefix}.{k}": k for k in given} | (extra or {})
        for key, field in keys.items():
            text = re.sub(rf"(config key )?'{re.escape(key)}'", f"{owner}.{field}", text)
            text = text.replace(key, f"{owner}.{field}")
        text = text.replace(" See config/README.md.", " See docs/api.md.")
        raise ConfigError(text) from None


def check_group_size(group_size: Any, owner: str = "") -> int | None:
    """G as an int (None: the method's rule), after checking it is a whole number >= 1 (ConfigError)."""
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ConfigError(f"{owner}group_size is {group_size!r}; give a whole number G >= 1 (each user's examples are "
                          "bounded to G), or None for the method's rule.")
    return int(group_size)


def check_target(method: Any, epsilon: Any, compute: Any, steps: Any) -> float:
    """The target epsilon as a float, after checking the cell's arguments (ConfigError / PrivacyError)."""
    from .errors import PrivacyError

    if method not in METHODS:
        raise ConfigError(f"method is {method!r}; allowed: {', '.join(METHODS)} (user-level sampling: 'uls').")
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or math.isnan(epsilon):
        raise PrivacyError(f"epsilon is {epsilon!r}; give a number > 0 (or math.inf for the non-private reference).")
    if not epsilon > 0:
        raise PrivacyError(f"epsilon is {epsilon}; a DP guarantee needs epsilon > 0 (e.g. 1, 4 or 8; math.inf for "
                           "the non-private reference without noise).")
    for name, value in (("compute", compute), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ConfigError(f"{name} is {value!r}; give a whole number >= 1 (compute: examples processed in "
                              "expectation over the run; steps: noisy steps T).")
    return float(epsilon)
