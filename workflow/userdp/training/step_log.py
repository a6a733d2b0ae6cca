"""The per-step training log (train_log.parquet): which columns are inside the guarantee, which are not.

Every step's row is computed (RunState.record) with all of LOG_COLUMNS, but
only some of them may leave the run:

- GUARANTEED_COLUMNS: public values (`step`, the scheduled `learning_rate`)
  and post-processing of the step's privatised update u = (clipped sum +
  noise) / (q N), the release the accountant composes: `update_norm` =
  ||u|| and `update_signal_norm` = sqrt(max(0, ||u||^2 - d (sigma C / (q N))^2)),
  which subtracts the noise's expected squared norm (d noised coordinates)
  and so estimates the norm of the mean clipped gradient. Functions of the
  DP output and public constants: covered by the (epsilon, delta) guarantee.
  With adaptive clipping also ADAPTIVE_COLUMNS: the step's clip norm and the
  noisy unclipped fraction it released (accounted with the update).
- DEBUG_COLUMNS: the batch loss, the realised batch sizes, the clipped
  fraction, the mean clipped-unit norm, the number of units dropped for a
  non-finite gradient (`nonfinite_units`, clipping.py) and the step's wall
  time. Each is a
  noise-free function of the sampled users' data; none is covered. They are
  written (train_log.parquet, the cell's copy, the rule log's progress
  lines) only with `training.debug_step_log: true`.

`released_columns(debug)` is what train_log.parquet (engine) and the cell's
copy (evaluation.select) hold. Torch-free.
"""

from __future__ import annotations

import math

GUARANTEED_COLUMNS = ["step", "learning_rate", "update_norm", "update_signal_norm"]
#: Adaptive clipping's released values (userdp.privacy.adaptive): the step's clip norm C_t and b_t, the noisy
#: unclipped fraction its count released. Inside the guarantee; only runs with adaptive clipping have them.
ADAPTIVE_COLUMNS = ["clip_norm", "unclipped_fraction_noisy"]
DEBUG_COLUMNS = [
    "loss", "realised_examples", "realised_users", "realised_units", "examples_processed", "clipped_fraction",
    "mean_unit_norm", "nonfinite_units", "seconds",
]
LOG_COLUMNS = GUARANTEED_COLUMNS + DEBUG_COLUMNS
KEY = "training.debug_step_log"


def released_columns(debug: bool, adaptive: bool = False) -> list[str]:
    """The columns a train log may hold: the guaranteed ones (adaptive clipping's after them), then, with
    `training.debug_step_log` (`debug`), the debug ones; with debug, every column a run's log row has."""
    return GUARANTEED_COLUMNS + (ADAPTIVE_COLUMNS if adaptive else []) + (DEBUG_COLUMNS if debug else [])


def signal_norm(update_sq_norm: float, n_coordinates: int, noise_std: float, divisor: float) -> float:
    """sqrt(max(0, ||u||^2 - d (std / divisor)^2)): the update's norm with the noise's expected share removed.

    u = (clipped sum + N(0, std^2 I_d)) / divisor, so E||u||^2 = ||clipped sum / divisor||^2 + d (std / divisor)^2.
    """
    noise_sq = n_coordinates * (float(noise_std) / float(divisor)) ** 2
    return math.sqrt(max(float(update_sq_norm) - noise_sq, 0.0))
