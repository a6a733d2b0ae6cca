"""From sampled units to fixed-shape physical micro-batches.

A step's sampled units (examples for ELS, users for ULS) become rows of the
pool, each with a weight: 1 for ELS; 1/(rows of the user this step) for ULS,
so a user's gradient is the average over its examples. Rows are packed into
micro-batches of exactly `physical_batch_size` rows and `sequence_length`
tokens; unused rows carry unit id -1, zero attention and zero weight. Shapes
never change, so memory is bounded and compiled kernels are reused, while the
logical (Poisson) batch keeps its random size. A unit never straddles two
micro-batches: clipping needs all rows of a unit in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError
from .pool import TrainingPool


@dataclass
class StepSelection:
    """The rows of one step, grouped by unit (rows of a unit are contiguous)."""

    rows: np.ndarray         # pool row indices
    unit_sizes: np.ndarray   # rows per unit, in order
    weights: np.ndarray      # per-row weight (float64)
    n_users: int             # distinct users in the step

    @property
    def n_units(self) -> int:
        return int(self.unit_sizes.shape[0])

    @property
    def n_examples(self) -> int:
        return int(self.rows.shape[0])


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [P, L] int64
    attention_mask: torch.Tensor  # [P, L] int64
    unit_ids: torch.Tensor        # [P] int64, -1 = padding row
    row_weights: torch.Tensor     # [P] float32
    n_rows: int                   # real (non-padding) rows
    loss_mask: torch.Tensor | None = None  # [P, L] bool: loss targets (chat data); None: every token


def select_els(pool: TrainingPool, sampled: np.ndarray) -> StepSelection:
    """ELS: every sampled pool example is its own unit."""
    rows = np.asarray(sampled, dtype=np.int64)
    return StepSelection(
        rows=rows,
        unit_sizes=np.ones(len(rows), dtype=np.int64),
        weights=np.ones(len(rows), dtype=np.float64),
        n_users=int(np.unique(pool.example_user[rows]).shape[0]),
    )


def select_uls(
    pool: TrainingPool,
    sampled_users: np.ndarray,
    examples_per_user: int | None = None,
    subset_keys: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> StepSelection:
    """ULS: every sampled user is a unit holding all its bounded examples.

    With `examples_per_user` = k, a user with more than k bounded examples
    contributes a uniformly random k of them this step: the k rows with the
    smallest `subset_keys(user indices, ranks)` (the sampler's per-user,
    per-step keys, PoissonSampler.subset_keys), so the choice of one user
    never depends on which other users were sampled or exist. Weights are
    1/(rows of the user) so the unit's gradient is the mean.
    """
    users = np.asarray(sampled_users, dtype=np.int64)
    starts = pool.user_offsets[users]
    sizes = pool.user_offsets[users + 1] - starts
    total = int(sizes.sum())
    unit_start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else np.zeros(0, np.int64)
    rank = np.arange(total) - np.repeat(unit_start, sizes)  # each row's rank among its user's rows
    rows = np.repeat(starts, sizes) + rank
    if examples_per_user is not None and np.any(sizes > examples_per_user):
        if subset_keys is None:
            raise ValueError("select_uls needs subset_keys when examples_per_user is set")
        unit = np.repeat(np.arange(len(users)), sizes)
        big = np.repeat(sizes > examples_per_user, sizes)
        keys = np.zeros(total, dtype=np.uint64)  # users with at most k rows keep them all
        keys[big] = subset_keys(users[unit[big]], rank[big])
        by_key = np.lexsort((keys, unit))  # within each user by key; users stay in order
        keep = by_key[rank < examples_per_user]  # `rank` of the sorted position: the first k of each user
        keep.sort()  # users in order, each user's kept rows in rank order
        rows = rows[keep]
        sizes = np.minimum(sizes, examples_per_user)
    weights = np.repeat(1.0 / np.maximum(sizes, 1), sizes)
    return StepSelection(rows=rows.astype(np.int64), unit_sizes=sizes.astype(np.int64), weights=weights, n_users=len(users))


def pack_micro_batches(
    pool: TrainingPool,
    sel: StepSelection,
    physical_batch_size: int,
    sequence_length: int,
    pad_id: int,
) -> list[MicroBatch]:
    """Pack the step's units greedily, in order, into fixed-shape micro-batches."""
    P, L = physical_batch_size, sequence_length
    batches: list[MicroBatch] = []
    if sel.n_units == 0:
        return batches
    unit_end = np.cumsum(sel.unit_sizes)
    unit_start = unit_end - sel.unit_sizes
    if int(sel.unit_sizes.max()) > P:
        raise ConfigError(
            f"a unit has {int(sel.unit_sizes.max())} rows but training.physical_batch_size is {P}; "
            "raise training.physical_batch_size."
        )
    groups: list[tuple[int, int]] = []  # unit index ranges per micro-batch
    first, rows_in = 0, 0
    for u, size in enumerate(sel.unit_sizes):
        if rows_in + size > P:
            groups.append((first, u))
            first, rows_in = u, 0
        rows_in += int(size)
    groups.append((first, sel.n_units))

    for u0, u1 in groups:
        r0, r1 = int(unit_start[u0]), int(unit_end[u1 - 1])
        ids = np.full((P, L), pad_id, dtype=np.int64)
        mask = np.zeros((P, L), dtype=np.int64)
        unit_ids = np.full(P, -1, dtype=np.int64)
        weights = np.zeros(P, dtype=np.float32)
        targets = None if pool.loss_mask_values is None else np.zeros((P, L), dtype=bool)
        for j, row in enumerate(sel.rows[r0:r1]):
            toks = pool.tokens(int(row))[:L]
            ids[j, : len(toks)] = toks
            mask[j, : len(toks)] = 1
            if targets is not None:
                targets[j, : len(toks)] = pool.loss_mask(int(row))[:L]
        n = r1 - r0
        unit_ids[:n] = np.repeat(np.arange(u1 - u0), sel.unit_sizes[u0:u1])
        weights[:n] = sel.weights[r0:r1]
        batches.append(
            MicroBatch(
                input_ids=torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                unit_ids=torch.from_numpy(unit_ids),
                row_weights=torch.from_numpy(weights),
                n_rows=n,
                loss_mask=None if targets is None else torch.from_numpy(targets),
            )
        )
    return batches
