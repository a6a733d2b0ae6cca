"""The seeds of one training run: derived from the config seed, its cell and learning rate
(`run_seeds`), or, for the sampler and the noise, drawn from OS entropy when they must stay secret
(`draw_secret_seeds`), and masked where they are written down (`public_seeds`). The derivation itself is
userdp.seeding's."""

from __future__ import annotations

import secrets
from typing import Any

import torch

from ..layout import fmt_num
from ..seeding import derive_seed
from . import distributed


def run_seeds(config_seed: int, run_seed: int, dataset: str, method: str, eps: str, budget: int | str,
              group_size: int, learning_rate: float | None = None, secret: bool = False,
              trial: int | None = None, option: str | None = None, audit: bool = False) -> dict[str, Any]:
    """Seeds of a run, derived from the config seed, the cell and its learning rate.

    The learning rate IS part of the seeds: runs of a learning-rate sweep that
    shared their batches and noise would let the noise cancel between two
    released models (with SGD, (theta0 - theta_a)/lr_a - (theta0 - theta_b)/lr_b
    is a noise-free sum of clipped gradients), so every rate draws its own
    Poisson samples and its own noise, and the k runs of a sweep compose as k
    independent mechanisms (see evaluation.select).

    secret: the sampler and noise seeds are replaced by fresh OS entropy when
    training starts (`privacy.secret_seeds`): with seeds derived from the
    config, anyone who has the config can regenerate the Poisson samples and
    the noise of a released model, which voids the guarantee.

    trial: the run's index among a random-stopping cell's runs
    (privacy.selection.accounting: random_stopping), which may draw the same
    learning rate twice; each run is an independent mechanism, so the index
    is part of its seeds.

    option: the name of the grid.options entry the run belongs to (None for the grid's own cells, whose
    seeds stay as they were): an option's run is another released model of the same cell, so it draws its
    own samples and noise too.

    audit: a run of the membership audit (rule audit_finetune), trained on the audit's tokens at a grid cell's
    settings: it draws its own samples and noise, never those of the grid's released model of that cell.
    """
    cell = (int(config_seed), dataset, method, eps, int(budget), int(group_size), int(run_seed))
    if learning_rate is not None:
        cell = cell + (fmt_num(float(learning_rate)),)
    if trial is not None:
        cell = cell + ("trial", int(trial))
    if option:
        cell = cell + ("option", str(option))
    if audit:
        cell = cell + ("audit",)
    return {
        "config": int(config_seed),
        "run": int(run_seed),
        "sampler": derive_seed(*cell, "sampler"),
        "noise": derive_seed(*cell, "noise"),
        "torch": derive_seed(*cell, "torch"),
        "secret": bool(secret),
    }


SECRET_SEEDS = ("sampler", "noise")


def draw_secret_seeds(seeds: dict[str, Any], dist: distributed.DistContext | None,
                      device: torch.device) -> dict[str, Any]:
    """`seeds` with the sampler and noise seeds drawn from OS entropy (rank 0's, sent to every rank).

    Every rank must draw the same Poisson sample, so rank 0 draws and broadcasts.
    """
    fresh = {k: secrets.randbits(63) for k in SECRET_SEEDS} if dist is None or dist.is_main else None
    fresh = distributed.broadcast_object(fresh, dist, device)
    return {**seeds, **fresh}


def public_seeds(seeds: dict[str, Any]) -> dict[str, Any]:
    """The seeds as written to the ledger and the checkpoint fingerprint: secret ones masked."""
    if not seeds.get("secret"):
        return dict(seeds)
    return {k: ("secret" if k in SECRET_SEEDS else v) for k, v in seeds.items()}
