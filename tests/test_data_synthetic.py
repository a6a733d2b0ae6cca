"""The synthetic corpus: contribution tail, alpha as diversity knob, determinism, public shift."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from userdp.data.synthetic import THEMES, SyntheticSource, public_topic_weights
from userdp.errors import ConfigError


def make(n_users=3000, seed=0, **kw) -> SyntheticSource:
    spec = {"source": "synthetic", "synthetic": {"n_users": n_users, **kw}}
    return SyntheticSource("synth", spec, "data/synth", seed)


def user_topic_entropy(src: SyntheticSource, min_examples: int = 10) -> float:
    """Mean entropy (nats) of the empirical topic distribution of users' examples."""
    t = src.generate_block(0)
    _, user = np.unique(t.column("user_id").to_numpy(zero_copy_only=False), return_inverse=True)
    k = src.params.n_topics
    counts = np.bincount(user * k + t.column("topic").to_numpy(), minlength=(user.max() + 1) * k).reshape(-1, k)
    counts = counts[counts.sum(axis=1) >= min_examples]
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return float(np.mean(ent))


def test_contributions_heavy_tailed_with_configured_median():
    src = make(n_users=20000, contributions_median=8, contributions_sigma=1.2, max_contributions=512)
    n = src.n_examples
    assert abs(np.median(n) - 8) <= 1
    q99 = np.quantile(n, 0.99)
    assert q99 / np.median(n) > 8  # heavy right tail: exp(2.33 * 1.2) ~ 16x the median
    assert n.max() <= 512 and n.min() >= 1
    # The tail is set by sigma: a lighter sigma gives a much shorter tail.
    light = make(n_users=20000, contributions_median=8, contributions_sigma=0.3).n_examples
    assert np.quantile(light, 0.99) / np.median(light) < 3


def test_cap_binds():
    n = make(n_users=5000, contributions_median=50, contributions_sigma=2.0, max_contributions=64).n_examples
    assert n.max() == 64 and (n == 64).mean() > 0.1


def test_alpha_controls_within_user_topic_entropy():
    low = user_topic_entropy(make(n_users=2048, alpha=0.05, contributions_median=20))
    high = user_topic_entropy(make(n_users=2048, alpha=5.0, contributions_median=20))
    # 8 topics: max entropy log 8 = 2.08 nats; one-topic users are near 0.
    assert low < 0.7
    assert high > 1.5
    assert high - low > 1.0


def test_topic_structure_is_visible_in_the_text():
    """Examples of topic k mostly use the content words of theme k."""
    src = make(n_users=500, alpha=1.0)
    t = src.generate_block(0)
    texts = t.column("text").to_pylist()
    topics = t.column("topic").to_numpy()
    theme_words = [set(th["N"]) | set(th["V"]) | set(th["A"]) for th in THEMES]
    hits = 0
    for text, z in zip(texts[:2000], topics[:2000]):
        words = text.split()
        counts = [sum(w in ws for w in words) for ws in theme_words[: src.params.n_topics]]
        hits += int(np.argmax(counts) == z)
    assert hits / 2000 > 0.8


def test_deterministic_and_independent_of_batch_rows():
    a = pa.Table.from_batches(list(make(n_users=3000).iter_batches(batch_rows=1000)))
    b = pa.Table.from_batches(list(make(n_users=3000).iter_batches(batch_rows=777)))
    assert a.equals(b)
    assert a.schema.names == ["user_id", "text", "source_split"]
    assert a.num_rows == int(make(n_users=3000).n_examples.sum())
    c = pa.Table.from_batches(list(make(n_users=3000, seed=1).iter_batches(batch_rows=1000)))
    assert not a.column("text").equals(c.column("text"))
    assert max(len(x) for x in make(n_users=3000).iter_batches(batch_rows=500)) <= 500


def test_users_and_counts_match():
    src = make(n_users=3000)
    t = pa.Table.from_batches(list(src.iter_batches()))
    counts = t.group_by("user_id").aggregate([("text", "count")])
    assert counts.num_rows == 3000
    assert sorted(counts.column("text_count").to_pylist()) == sorted(src.n_examples.tolist())


def test_public_corpus_has_shifted_topic_mixture():
    src = make(n_users=100, public_examples=5000, public_shift=1.0)
    assert src.has_public()
    rng = np.random.default_rng(0)
    z = src.public_topics(20000, rng)
    freq = np.bincount(z, minlength=8) / len(z)
    w = public_topic_weights(8, 1.0)
    assert np.allclose(freq, w, atol=0.01)
    assert freq[0] > 5 * freq[-1]  # private users are symmetric in expectation; public is not
    pub = pa.Table.from_batches(list(src.iter_public(1000)))
    assert pub.num_rows == 5000 and pub.schema.names == ["text"]
    assert not make(n_users=100, public_examples=0).has_public()


def test_max_examples_caps_the_stream():
    spec = {"source": "synthetic", "max_examples": 123, "synthetic": {"n_users": 500}}
    src = SyntheticSource("s", spec, "data/s", 0)
    assert sum(b.num_rows for b in src.iter_batches(50)) == 123


@pytest.mark.parametrize(
    "bad, key",
    [({"alpha": 0}, "alpha"), ({"n_users": 0}, "n_users"), ({"colour": 1}, "colour"), ({"contributions_median": 900}, "contributions_median")],
)
def test_bad_settings_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        make(**bad)

