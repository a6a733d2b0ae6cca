"""userdp.seeding: every seed derivation and keyed hash keeps producing the same numbers.

The values pin seeding scheme 2 (`SCHEME`); a change here changes every seeded
result of the pipeline and needs a new scheme number (the rules that show it
as a param then rerun their jobs). derive_seed, the bounding and sampling keys,
row_keys and step_draws kept their scheme-1 values.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import pytest

from userdp import seeding
from userdp.data.prepare import _split_hash
from userdp.seeding import (SAMPLE_PERSON, SPLIT_PERSON, derive_seed, row_keys, splitmix64, step_draws, unit_interval,
                            user_hashes)


def test_derive_seed_known_values():
    assert derive_seed(0, "tiny", 0, 2, "bounding") == 4887703270076879843
    assert derive_seed(7, "model_init") == 1159724015044821593
    assert derive_seed(1, "contribution_stats", "fortunes") == 4416450327910780580
    assert derive_seed(0, "synthetic", "els", "1", 100, 4, 0, "0.001", "sampler") == 2099644416227628720
    assert 0 <= derive_seed("x") < 2**63


def test_integer_seeds_are_one_scheme():
    """Evaluation users, the group bootstrap, the canaries and the mean-estimation study derive their seeds with
    derive_seed too (scheme 1 used crc32-keyed SeedSequences there)."""
    assert derive_seed(0, "evaluation", "synthetic", "validation") == 2152598930078948994
    assert derive_seed(42, "evaluation", "fortunes", "test") == 1077457343613315920
    assert seeding.SCHEME == 2
    assert not hasattr(seeding, "seed_sequence") and not hasattr(seeding, "derive_seed_crc32")


def test_splitmix64_known_values():
    got = splitmix64(np.array([0, 1, 2**63], dtype=np.uint64))
    assert [int(x) for x in got] == [16294208416658607535, 10451216379200822465, 5196802822362493915]


def test_split_hash_known_values():
    """The user split: the keyed per-user hash under the split personalisation, mapped to [0, 1)."""
    ids = ["user-7", "", "日本"]
    assert [int(x) for x in user_hashes(ids, 123, person=SPLIT_PERSON)] == [
        4116472155144684943, 4930206640090721399, 1609311526287498719]
    got = _split_hash(pa.array(ids), 123)
    assert [float(x).hex() for x in got] == ["0x1.c9052cebb97c0p-3", "0x1.11ae73456f84ap-2", "0x1.6556c4e814ed8p-4"]
    assert np.array_equal(got, unit_interval(user_hashes(ids, 123, person=SPLIT_PERSON)))
    assert unit_interval(np.array([0, 2**63, 2**64 - 1], dtype=np.uint64)).tolist() == [0.0, 0.5, 1 - 2**-53]


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
