"""Poisson sampling of examples (ELS) or users (ULS), stable under removing a user.

The accountant assumes Poisson subsampling: at every step each unit (an
example of the bounded pool for ELS, a train user for ULS) is included
independently with probability q. Realised batch sizes therefore vary from
step to step (Binomial(N, q)); this module never "fixes" that with
shuffling or fixed-size batches, which would change the mechanism and void
the privacy accounting.

Each unit's draw is a keyed hash of (seed, its identity, the step), not the
i-th number of one stream: unit identities are the user id (ULS) or (user
id, the row's rank among the user's bounded rows) (ELS), keyed by the
sampler seed (`seeding.user_hashes` with the sampling personalisation, then
`seeding.row_keys`), and step t's draw of a unit is
`seeding.step_draws(key, t, INCLUDE)`. So on D and on D minus one user
every other unit gets the very same draws (docs/method.md section 11,
invariant 7; tests/test_replay_neighbouring.py); with one stream, removing a
user shifted every later unit's draws. The draws are 64-bit splitmix64
outputs of distinct inputs, one per unit and step, compared with q 2^64:
independent Bernoulli(q) per unit per step, as the accountant assumes
(tests/test_train_sampling.py checks frequencies and sizes).

The same holds for ULS with `training.uls_examples_per_user: k`: a user
with more than k bounded rows contributes the k rows with the smallest keys
`row_keys(step_draws(user key, t, SUBSET), rank)`, a uniformly random
k-subset that depends on that user and the step alone.

The state is the seed and the step counter (a checkpoint holds both, so a
resumed run, also with secret seeds, draws exactly the batches an
uninterrupted run would).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..seeding import SAMPLE_PERSON, row_keys, step_draws, user_hashes

INCLUDE, SUBSET, PARTITION = 0, 1, 2  # streams of step_draws: inclusion, ULS row subsets, cyclic partitions


def _threshold(rate: float) -> int | None:
    """The integer t with P(draw < t) = t / 2^64 = q for a uniform 64-bit draw; None when q = 1 (all units)."""
    if rate >= 1.0:
        return None
    return int(float(rate) * 2.0 ** 64)  # exact: scaling a double by a power of two


class PoissonSampler:
    """Include each unit independently with probability `rate`, by a keyed hash of (seed, unit, step).

    user_ids: the pool's train user ids. Without `unit_user` the units are
    the users (ULS); with it, unit i is row `unit_rank[i]` of user
    `user_ids[unit_user[i]]` (ELS: the pool's rows). Use `for_pool`.
    """

    SCHEME = "keyed-splitmix64/v1"  # part of the checkpoint fingerprint: a change never resumes an old run

    def __init__(self, user_ids: Sequence[str], rate: float, seed: int, unit_user: np.ndarray | None = None,
                 unit_rank: np.ndarray | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"sampling rate must be in [0, 1], got {rate}")
        if (unit_user is None) != (unit_rank is None):
            raise ValueError("unit_user and unit_rank go together")
        self.user_ids = list(user_ids)
        self._unit_user = None if unit_user is None else np.asarray(unit_user, np.int64)
        self._unit_rank = None if unit_rank is None else np.asarray(unit_rank, np.int64)
        self.n_units = len(self.user_ids) if self._unit_user is None else int(self._unit_user.shape[0])
        self.rate = float(rate)
        self._thr = _threshold(self.rate)
        self.step = 0  # draws made so far (the next sample is step `step`)
        self._set_seed(int(seed))

    @classmethod
    def for_pool(cls, pool: Any, unit: str, rate: float, seed: int) -> "PoissonSampler":
        """The sampler of a TrainingPool: over its users ("users", ULS) or its bounded rows ("examples", ELS)."""
        if unit == "users":
            return cls(pool.user_ids, rate, seed)
        if unit != "examples":
            raise ValueError(f"unit must be 'users' or 'examples', got {unit!r}")
        user = np.asarray(pool.example_user, np.int64)
        rank = np.arange(user.shape[0], dtype=np.int64) - np.asarray(pool.user_offsets, np.int64)[user]
        return cls(pool.user_ids, rate, seed, user, rank)

    def _set_seed(self, seed: int) -> None:
        self.seed = seed
        self._user_keys = user_hashes(self.user_ids, seed, person=SAMPLE_PERSON)
        self._unit_keys = (self._user_keys if self._unit_user is None
                           else row_keys(self._user_keys[self._unit_user], self._unit_rank))

    def sample(self) -> np.ndarray:
        """Indices (sorted, int64) of the units included in this step; advances the step."""
        t, self.step = self.step, self.step + 1
        if self._thr is None:
            return np.arange(self.n_units, dtype=np.int64)
        if self._thr == 0:
            return np.zeros(0, np.int64)
        return np.flatnonzero(step_draws(self._unit_keys, t, INCLUDE) < np.uint64(self._thr)).astype(np.int64)

    def subset_keys(self, users: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """uint64 keys of rows (user index, rank among the user's rows) for the step last sampled.

        ULS with uls_examples_per_user = k keeps each user's k rows with the smallest keys.
        """
        if self.step == 0:
            raise RuntimeError("subset_keys is for the step last sampled; call sample() first")
        per_user = step_draws(self._user_keys[np.asarray(users, np.int64)], self.step - 1, SUBSET)
        return row_keys(per_user, np.asarray(ranks, np.int64))

    def state_dict(self) -> dict[str, Any]:
        return {"scheme": self.SCHEME, "n_units": self.n_units, "rate": self.rate, "seed": self.seed,
                "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scheme") != self.SCHEME:
            raise ValueError(f"sampler state has scheme {state.get('scheme')!r}, this sampler is {self.SCHEME!r}")
        if int(state["n_units"]) != self.n_units or float(state["rate"]) != self.rate:
            raise ValueError("sampler state belongs to a different pool or sampling rate")
        if int(state["seed"]) != self.seed:
            self._set_seed(int(state["seed"]))  # a secret seed drawn by the run that wrote the checkpoint
        self.step = int(state["step"])


class CyclicPoissonSampler(PoissonSampler):
    """Cyclic Poisson sampling of users over b partitions (banded DP-FTRL, userdp.privacy.banded).

    User u belongs to partition `step_draws(key_u, 0, PARTITION) mod b`, a keyed hash of its own id (independent
    of every other user: removing a user moves no one); step t samples the users of partition t mod b, each
    with probability `rate` (p, the within-partition rate) by the same keyed draws as PoissonSampler. So a user
    takes part at most once in any b consecutive steps, as the accountant assumes.
    """

    SCHEME = "keyed-splitmix64-cyclic/v1"

    def __init__(self, user_ids: Sequence[str], rate: float, seed: int, bands: int):
        if int(bands) < 1:
            raise ValueError(f"bands must be >= 1, got {bands}")
        self.bands = int(bands)
        super().__init__(user_ids, rate, seed)

    def _set_seed(self, seed: int) -> None:
        super()._set_seed(seed)
        # each user's partition in [0, b): a keyed draw of its own sampling key
        self.partitions = (step_draws(self._user_keys, 0, PARTITION) % np.uint64(self.bands)).astype(np.int64)

    def sample(self) -> np.ndarray:
        t = self.step
        included = super().sample()
        return included[self.partitions[included] == t % self.bands]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bands": self.bands}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("bands", 0)) != self.bands:
            raise ValueError(f"sampler state has {state.get('bands')} bands, this sampler {self.bands}")
        super().load_state_dict(state)
