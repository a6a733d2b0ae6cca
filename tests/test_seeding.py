"""userdp.seeding: every seed derivation and keyed hash keeps producing the same numbers.

The values were computed with the routines where they lived before they were
gathered in userdp.seeding (training.sampling, evaluation.metrics,
training.pool, data.prepare, experiments.mean_estimation_population); a
change here changes every seeded result of the pipeline.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import pytest

from userdp.seeding import (SAMPLE_PERSON, derive_seed, derive_seed_crc32, hash_unit, row_keys, seed_sequence,
                            split_seed, splitmix64, step_draws, user_hashes)


def test_derive_seed_known_values():
    assert derive_seed(0, "tiny", 0, 2, "bounding") == 4887703270076879843
    assert derive_seed(7, "model_init") == 1159724015044821593
    assert derive_seed(1, "contribution_stats", "fortunes") == 4416450327910780580
    assert derive_seed(0, "synthetic", "els", "1", 100, 4, 0, "0.001", "sampler") == 2099644416227628720
    assert 0 <= derive_seed("x") < 2**63


def test_derive_seed_crc32_known_values():
    assert derive_seed_crc32(0, "evaluation", "synthetic", "validation") == 7021717917581735044
    assert derive_seed_crc32(42, "evaluation", "fortunes", "test") == 7869428020413368329
    assert derive_seed_crc32(3, 5, "x") == 3895363214442967413  # int parts are hashed as text too


def test_seed_sequence_known_values():
    ss = seed_sequence(0, "mean_estimation", "contributions")
    assert [int(x) for x in ss.generate_state(2, np.uint64)] == [8856949945886044602, 1751442622874260296]
    ss = seed_sequence(5, "mean_estimation", "train", "sweep", 1, "els", 2.5)
    assert [int(x) for x in ss.generate_state(2, np.uint64)] == [1873076391362448446, 9907721240147874026]


def test_splitmix64_known_values():
    got = splitmix64(np.array([0, 1, 2**63], dtype=np.uint64))
    assert [int(x) for x in got] == [16294208416658607535, 10451216379200822465, 5196802822362493915]


def test_split_hash_known_values():
    assert split_seed(0) == 3683187238809711677
    assert split_seed(123) == 14461329536866355626
    got = hash_unit(pa.array(["user-7", "", "日本"]), 123)
    assert [float(x).hex() for x in got] == ["0x1.3c079c198a105p-1", "0x1.ec2a6de40480bp-1", "0x1.748f8aed088c5p-1"]


def test_bounding_keys_known_values():
    assert [int(x) for x in user_hashes(["user0", "user1", "ümlaut"], 9)] == [
        4454485306037461803, 9014972373595280277, 2183569393218114433]
    assert [int(x) for x in row_keys(user_hashes(["a", "b"], 3), np.array([0, 5]))] == [
        7799067197327303226, 1695413712754639320]


def test_sampling_keys_and_step_draws_known_values():
    """The Poisson sampler's unit keys (sampling personalisation, not the bounding one) and per-step draws."""
    h = user_hashes(["user0", "user1", "ümlaut"], 9, person=SAMPLE_PERSON)
    assert [int(x) for x in h] == [11791317760900332672, 11152272049585340535, 13400453122885410911]
    assert [int(x) for x in step_draws(h, 0)] == [265619918601434341, 5502208831294724610, 11012931215788670357]
    assert [int(x) for x in step_draws(h, 41, 1)] == [14410129406355726210, 10703215293496513924,
                                                      3943736760613898786]
    # the definition, written out: splitmix64(key + splitmix64(step ^ (stream << 56)))
    with np.errstate(over="ignore"):
        off = splitmix64(np.array([41 ^ (1 << 56)], dtype=np.uint64))[0]
        assert np.array_equal(step_draws(h, 41, 1), splitmix64(h + off))
    keys = np.arange(3 * (1 << 16) + 5, dtype=np.uint64)  # several chunks of the in-place loop
    with np.errstate(over="ignore"):
        assert np.array_equal(step_draws(keys, 3), splitmix64(keys + splitmix64(np.array([3], np.uint64))[0]))
    with pytest.raises(ValueError):
        step_draws(h, -1)
