"""Every seed derivation and keyed hash of the package, in one place.

Seeds make the study reproducible: a run, a bounded pool, a user split or an
evaluation set is a function of the config seed and readable labels. Each
routine below feeds seeds or keys into results, so its output must never
change (tests/test_seeding.py pins known values). Several families coexist
because they were chosen for different needs; they compute different
numbers and are not interchangeable:

- `derive_seed`: SHA-256 of "|"-joined parts -> 63-bit seed (training runs,
  bounding, pretraining, contribution statistics);
- `derive_seed_crc32`: numpy SeedSequence of the root seed and crc32 of every
  part -> 63-bit seed (evaluation users);
- `seed_sequence`: numpy SeedSequence of int parts as they are and crc32 of
  text parts (mean-estimation study; `spawn`-able);
- `split_seed` + `hash_unit`: the user-split key and FNV-1a 64 + splitmix64
  of each user id's UTF-8 bytes -> [0, 1) (data preparation);
- `user_hashes` + `row_keys`: blake2b keyed by the seed of each user id, mixed
  with a row's rank by splitmix64 (contribution bounding of the training pool;
  with the sampling personalisation, the identities of the sampled units);
- `step_draws`: splitmix64 of a unit's key and the step (Poisson sampling of
  training: every unit's draw depends on its own identity, the seed and the
  step alone, so removing a user changes no other unit's draws).

Python's `hash` is salted per process, so none of them uses it. This module
imports nothing from the pipeline stages.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# ------------------------------------------------------------ integer seeds


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (config seed, cell fields, a purpose name).

    The parts are joined with "|" as text and hashed with SHA-256.
    """
    text = "|".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1


def derive_seed_crc32(root_seed: int, *parts: str | int) -> int:
    """A 63-bit seed from the config seed and names: SeedSequence([root, crc32(part), ...]).

    Every part (also an int) is hashed as its text with crc32; the evaluation
    users are chosen with it.
    """
    words = [int(root_seed)] + [zlib.crc32(str(p).encode("utf-8")) for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def seed_sequence(*parts: object) -> np.random.SeedSequence:
    """A SeedSequence derived from the config seed and a cell's description.

    Int parts enter as they are; text parts are hashed (crc32), so a cell is
    identified by readable labels such as ("els", "eps=1", "budget=20000")
    rather than by positions in a list.
    """
    words: list[int] = []
    for p in parts:
        if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
            words.append(int(p))
        else:
            words.append(zlib.crc32(str(p).encode("utf-8")))
    return np.random.SeedSequence(words)


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


# ------------------------------------------------------------ the user split

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def split_seed(seed: int) -> int:
    """The hash key of the user split (64 bits), derived from the root seed.

    It does not involve the dataset name, so the same user id lands in the
    same split in two datasets built from the same users.
    """
    return int(np.random.SeedSequence([seed, zlib.crc32(b"user-split")]).generate_state(1, np.uint64)[0])


def hash_unit(user_ids: pa.Array | pa.ChunkedArray, seed: int) -> np.ndarray:
    """A seeded hash of each string mapped to [0, 1), vectorised (FNV-1a 64 + splitmix64).

    Stable across platforms, runs and batchings: it reads the UTF-8 bytes.
    """
    if isinstance(user_ids, pa.ChunkedArray):
        user_ids = user_ids.combine_chunks()
    arr = pc.cast(user_ids, pa.large_string())
    n = len(arr)
    if n == 0:
        return np.zeros(0)
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64, count=arr.offset + n + 1)[arr.offset :]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(1, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64) ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        for j in range(int(lengths.max(initial=0))):
            live = np.nonzero(lengths > j)[0]
            h[live] = (h[live] ^ data[starts[live] + j].astype(np.uint64)) * _FNV_PRIME
        h = splitmix64(h)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# ------------------------------------------------------------ bounding keys

_BOUND_PERSON = b"userdp.bound"  # blake2b personalisation: domain separation from other uses of the seed
SAMPLE_PERSON = b"userdp.sample"  # the same hash for the identities of Poisson-sampled units (training.sampling)


def user_hashes(user_ids: Sequence[str], seed: int, person: bytes = _BOUND_PERSON) -> np.ndarray:
    """A 64-bit keyed hash (blake2b, keyed by the seed) of each user id string [N] uint64.

    The per-user key of contribution bounding (`person` = the bounding
    personalisation, the default) or of sampling (`SAMPLE_PERSON`). One hash
    per distinct user (~0.6 us each: a second per million users); it depends
    on the id string, the seed and `person` only.
    """
    keyed = hashlib.blake2b(digest_size=8, key=str(int(seed)).encode(), person=person)
    ids = user_ids.tolist() if isinstance(user_ids, np.ndarray) else user_ids  # Python str: faster to encode

    def digest(u: str) -> bytes:
        h = keyed.copy()  # the keyed state is set up once, not per user
        h.update(str(u).encode("utf-8"))
        return h.digest()

    digests = b"".join(map(digest, ids))
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


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
