"""Every seed derivation and keyed hash of the package: one scheme, in one place.

Seeds make the study reproducible: a run, a bounded pool, a user split or an
evaluation set is a function of the config seed and readable labels. The
scheme has three parts, each with one job:

1. **Integer seeds**: `derive_seed(root, labels...)`, SHA-256 of the
   "|"-joined labels -> 63 bits. Every seeded generator of the package
   starts from one (`np.random.default_rng(derive_seed(...))`, torch's
   `manual_seed`): training runs (sampler, noise, torch: run_seeds;
   random stopping's number of runs), contribution bounding, LoRA's
   initialisation, pretraining (model, batches), the synthetic corpus
   (topics, users, blocks of users, public text), evaluation users, the
   group bootstrap, the findings' audit bootstrap, the DP contribution
   statistics, the mechanism audit, the canaries and the audit's users,
   the mean-estimation study (populations, sampling, noise). Two purposes
   differ in their labels, never in the hash.
2. **Per-user keys**: `user_hashes(user ids, seed, person)`, blake2b keyed
   by a seed, with a personalisation naming the use (`SPLIT_PERSON`: the
   train/validation/test split; the default: contribution bounding;
   `SAMPLE_PERSON`: Poisson sampling; `AUDIT_USERS_PERSON`: the audit's
   subset of train users). A user's key depends on its id, the seed and
   the use alone, so removing a user changes no other user's key.
   `unit_interval` maps keys to [0, 1).
3. **Draws per key and counter**: splitmix64 mixing (`row_keys`: a user's
   rows by rank; `step_draws`: a unit at a training step), so each
   (unit, step) pair gets its own uniform draw.

`SCHEME` numbers this scheme. The rules that draw first from it (data
preparation, the mean-estimation study) show it as a param (`seeding`), so
a new scheme reruns them and, through their outputs, every job after them;
a new scheme that changed only a later derivation (evaluation users, a
bootstrap) must add the param to the rules that use it. Scheme 2 (this
one) replaced the other derivations of scheme 1: crc32-keyed SeedSequences
(evaluation users, the group bootstrap, the mean-estimation study, the
canaries: a 32-bit hash of each label, so two labels could collide into one
stream), the synthetic corpus's SeedSequence([seed, constant]) streams, a
fixed seed of the findings' audit bootstrap, and an unkeyed FNV-1a hash for
the user split (now a keyed hash like every other per-user key). Python's `hash` is salted per process, so none of
them uses it. This module imports nothing from the pipeline stages.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

#: The number of this seeding scheme (a rule param where it decides outputs; see the module docstring).
SCHEME = 2

# ------------------------------------------------------------ integer seeds


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (config seed, cell fields, a purpose name).

    The parts are joined with "|" as text and hashed with SHA-256.
    """
    text = "|".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1


# ------------------------------------------------------------ 64-bit mixing

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 (Steele et al. 2014) on a uint64 array: a bijection whose outputs look uniform.

    Wrapping uint64 arithmetic, vectorised; returns a new array.
    """
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
    return z


# ------------------------------------------------------------ per-user keys

_BOUND_PERSON = b"userdp.bound"  # blake2b personalisation: domain separation from other uses of the seed
SAMPLE_PERSON = b"userdp.sample"  # the same hash for the identities of Poisson-sampled units (training.sampling)
SPLIT_PERSON = b"userdp.split"  # the user split (data.prepare); keyed by the config seed, not the dataset
AUDIT_USERS_PERSON = b"userdp.audit"  # the audit's subset of train users (data.canaries)


def user_hashes(user_ids: Sequence[str], seed: int, person: bytes = _BOUND_PERSON) -> np.ndarray:
    """A 64-bit keyed hash (blake2b, keyed by the seed) of each user id string [N] uint64.

    The per-user key of contribution bounding (`person` = the bounding
    personalisation, the default), of sampling (`SAMPLE_PERSON`), of the
    user split (`SPLIT_PERSON`) or of the audit's users
    (`AUDIT_USERS_PERSON`). One hash per distinct user (~0.6 us each: a
    second per million users); it depends on the id string, the seed and
    `person` only.
    """
    keyed = hashlib.blake2b(digest_size=8, key=str(int(seed)).encode(), person=person)
    ids = user_ids.tolist() if isinstance(user_ids, np.ndarray) else user_ids  # Python str: faster to encode

    def digest(u: str) -> bytes:
        h = keyed.copy()  # the keyed state is set up once, not per user
        h.update(str(u).encode("utf-8"))
        return h.digest()

    digests = b"".join(map(digest, ids))
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def unit_interval(keys: np.ndarray) -> np.ndarray:
    """Uniform 64-bit keys mapped to floats in [0, 1) (their top 53 bits)."""
    return (np.asarray(keys, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def row_keys(user_hash: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Uniform 64-bit key of each row from its user's hash and its position among the user's rows.

    key = splitmix64(h_u + splitmix64(position)): for a fixed user it is a
    bijection of the position, so a user's rows never tie, and it depends on
    nothing but (seed, user id, the row's rank in the user's example-id order).
    """
    with np.errstate(over="ignore"):
        return splitmix64(user_hash + splitmix64(positions.astype(np.int64).view(np.uint64)))


# ------------------------------------------------------------ per-step draws

_STEP_CHUNK = 1 << 16  # elements per pass: the work arrays stay in cache


def step_draws(keys: np.ndarray, step: int, stream: int = 0) -> np.ndarray:
    """A uniform 64-bit draw for every unit key at one step [N] uint64.

    draw = splitmix64(key + splitmix64(step ^ (stream << 56))): for a fixed
    key the inputs of distinct steps (and streams) differ, and so do those of
    distinct keys at one step, so every (unit, step) pair gets its own
    splitmix64 output; a unit's draw depends on nothing but its key, the
    step and the stream. Keys should be uniform 64-bit values (`user_hashes`,
    `row_keys`). step < 2^56, stream < 256.
    """
    if not 0 <= int(step) < (1 << 56) or not 0 <= int(stream) < 256:
        raise ValueError(f"step must be in [0, 2^56) and stream in [0, 256), got {step}, {stream}")
    offset = splitmix64(np.array([int(step) ^ (int(stream) << 56)], dtype=np.uint64))[0]
    keys = np.asarray(keys, dtype=np.uint64)
    out = np.empty_like(keys)
    tmp = np.empty(min(_STEP_CHUNK, keys.shape[0]), dtype=np.uint64)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    with np.errstate(over="ignore"):
        start = offset + _GOLDEN
        # splitmix64(keys + offset) written in place, chunk by chunk (1.6x faster than `splitmix64` on 1e7 keys)
        for lo in range(0, keys.shape[0], _STEP_CHUNK):
            z = out[lo:lo + _STEP_CHUNK]
            t = tmp[: z.shape[0]]
            np.add(keys[lo:lo + _STEP_CHUNK], start, out=z)
            np.right_shift(z, s30, out=t)
            z ^= t
            z *= _MIX1
            np.right_shift(z, s27, out=t)
            z ^= t
            z *= _MIX2
            np.right_shift(z, s31, out=t)
            z ^= t
    return out
