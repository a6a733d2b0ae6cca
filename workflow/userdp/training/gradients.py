"""The seam between the training engine and whatever computes clipped per-unit gradients.

A gradient source (`GradientSource`) is built for a model, a clip norm and a
clipping mode; for every micro-batch it adds sum_u clip(g_u) into `.grad` of
the model's trainable parameters and returns the micro-batch's statistics as
a `MicroBatchStats`. The engine's default is
`userdp.training.clipping.ClippedGradients`; tests pass brute-force
references with the same interface.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch


@dataclasses.dataclass(frozen=True)
class MicroBatchStats:
    """What one micro-batch's clipped pass computed.

    loss_sum: sum of the kept rows' mean-token losses. n_rows: rows kept. n_units: units in the micro-batch.
    unit_ids: the units, ascending (None when the source does not say). unit_norms: their pre-clip gradient
    norms in the same order (empty or None without clipping). clipped_fraction: the units whose clip factor is
    below 1 (non-finite ones included). nonfinite_units: units whose norm was NaN or inf; they contributed zero
    and their rows are left out of loss_sum and n_rows.
    """

    loss_sum: float
    n_rows: int
    n_units: int
    unit_norms: torch.Tensor | None = None
    clipped_fraction: float = 0.0
    nonfinite_units: int = 0
    unit_ids: torch.Tensor | None = None


class GradientSource(Protocol):
    """Adds the clipped per-unit gradient sum of a micro-batch into p.grad (rows with unit id -1 are ignored).

    clip_norm: the C it clips at, read at every `accumulate` (adaptive clipping sets it before each step; a source
    without the attribute is refused for adaptive clipping); clipped_fraction of its result counts the units
    above it, which adaptive clipping's count releases.

    loss_mask [B, L] bool: the tokens that are loss targets (chat and instruction data: the answers); None:
    every token after a row's first. A row's loss is the mean cross-entropy over its targets.
    """

    clip_norm: float | None

    def accumulate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, unit_ids: torch.Tensor,
                   row_weights: torch.Tensor, loss_mask: torch.Tensor | None = None) -> MicroBatchStats: ...


class GradientSourceFactory(Protocol):
    """Builds a gradient source for a model: `(model, clip_norm, normalize=...)`; clip_norm None = no clipping."""

    def __call__(self, model: torch.nn.Module, clip_norm: float | None, *, normalize: bool = False
                 ) -> GradientSource: ...
