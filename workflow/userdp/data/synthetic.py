"""The embedded synthetic user corpus (offline default).

A seeded generator with the properties the study's conclusions depend on:

- heavy-tailed contributions: user u writes n_u = clip(round(LogNormal(log
  median, sigma)), 1, max_contributions) examples;
- intra-user diversity: user u has a topic mixture theta_u ~ Dirichlet(alpha
  * 1); each example draws one topic z ~ theta_u and all its sentences come
  from that topic's language model. Small alpha: a user writes about one
  topic; large alpha: a user's examples are spread over topics;
- an optional minority structure: `topic_weights` (one positive weight per
  topic) makes the prior Dirichlet(alpha * K * w / sum(w)), so topic k is
  the main topic of about a share w_k / sum(w) of users; topics whose weight
  is below half the largest are "rare" (`RARE_TOPIC_FRACTION`), and each
  user's label (`user_labels`: "rare" or "common", from the user's main
  topic argmax theta_u) is the topic group of userdp.evaluation.groups.
  Null (the default) is the uniform prior, bit for bit as before the key;
- topic language models over a real English vocabulary: sentences follow a
  small grammar (templates of determiners, adjectives, nouns, verbs,
  prepositions, ...) whose content words come from a topic-specific Zipf
  distribution, and adjectives/verbs prefer collocations of the noun they
  attach to, so a small transformer finds both topic and bigram structure;
- a public corpus from a shifted global topic mixture (weights proportional
  to exp(-public_shift * k)), for non-private pretraining and the tokenizer,
  so fine-tuning has a distribution shift to close. An explicit
  `datasets.<name>.public` key replaces it (open_source, userdp.data.public).

Everything is vectorised with numpy/pyarrow: users are generated in fixed
blocks of `_BLOCK_USERS` users, each from its own seed, so the text does not
depend on `batch_rows` and memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import ConfigError
from ..seeding import derive_seed
from .base import PUBLIC_SCHEMA, RAW_SCHEMA
from .sources import source_keys
from .spec_keys import check_keys, max_examples

# ---------------------------------------------------------------- vocabulary
# Themes of real English words. Topic k uses theme k % len(THEMES) (with its
# own seeded Zipf ranking when there are more topics than themes).
# Verbs are past tense so that any subject reads grammatically.
THEMES: list[dict[str, list[str]]] = [
    {  # cooking
        "N": "recipe oven onion garlic sauce pasta flour butter pan knife salad soup bread cheese pepper kitchen dough spoon tomato lemon chicken rice spice steak bowl".split(),
        "V": "baked chopped stirred roasted tasted seasoned boiled grilled mixed served sliced fried".split(),
        "A": "crispy spicy fresh savory tender sweet salty creamy golden juicy".split(),
    },
    {  # sports
        "N": "team coach goal match player ball season league referee stadium striker keeper trophy score pitch tournament fan defender injury champion racket court helmet sprint".split(),
        "V": "scored tackled kicked trained defended passed won lost coached dribbled blocked cheered".split(),
        "A": "fast strong winning tired rival brilliant aggressive talented young athletic".split(),
    },
    {  # computing
        "N": "server database query function compiler variable kernel thread array bug script browser packet cache loop module library socket process memory pointer string file terminal".split(),
        "V": "compiled crashed debugged deployed parsed cached refactored installed returned queried allocated logged".split(),
        "A": "null recursive binary async remote local static broken deprecated verbose".split(),
    },
    {  # music
        "N": "guitar melody chord drummer song album concert piano singer rhythm chorus violin band lyric tempo stage orchestra note verse microphone record bass harmony solo".split(),
        "V": "played sang recorded tuned composed strummed performed rehearsed released mixed hummed toured".split(),
        "A": "loud acoustic catchy soulful gentle minor electric live melodic haunting".split(),
    },
    {  # weather and nature
        "N": "storm river forest cloud rain mountain snow wind valley thunder lake meadow fog breeze glacier sunset hill ocean wave tree frost drought flood sky".split(),
        "V": "poured froze flooded drifted melted howled glowed thundered rolled swept blew rose".split(),
        "A": "cold misty stormy sunny frozen windy humid foggy bright calm".split(),
    },
    {  # finance
        "N": "market stock bond investor bank loan interest dividend budget portfolio profit fund price tax mortgage currency inflation asset debt broker share index revenue credit".split(),
        "V": "invested traded borrowed paid rallied crashed saved earned audited hedged lent priced".split(),
        "A": "volatile bullish bearish fiscal risky annual net liquid quarterly stable".split(),
    },
    {  # travel
        "N": "flight airport hotel passport ticket luggage beach island train museum map tourist guide village border cruise harbor suitcase visa hostel station route souvenir tour".split(),
        "V": "booked traveled visited packed landed explored checked toured boarded wandered departed arrived".split(),
        "A": "exotic crowded scenic remote cheap foreign historic sandy quiet coastal".split(),
    },
    {  # health
        "N": "doctor patient nurse fever vaccine clinic symptom diet muscle heart pill therapy surgery virus blood sleep exercise injury hospital lung vitamin dose pain cough".split(),
        "V": "treated diagnosed prescribed healed examined recovered injected vaccinated stretched rested breathed coughed".split(),
        "A": "chronic healthy acute sore painful mild sick medical severe immune".split(),
    },
    {  # astronomy
        "N": "planet star galaxy telescope orbit comet rocket moon astronaut asteroid nebula satellite crater eclipse universe gravity meteor spacecraft cosmos launch mission probe horizon light".split(),
        "V": "orbited launched observed collapsed exploded landed drifted spun captured mapped detected glowed".split(),
        "A": "distant lunar solar cosmic dark massive stellar orbital bright faint".split(),
    },
    {  # gardening
        "N": "garden seed soil flower rose shovel compost weed root hedge tulip fence lawn bulb greenhouse vine orchard pot leaf blossom fertilizer mulch sprout bee".split(),
        "V": "planted watered pruned weeded dug harvested bloomed grew sprouted mowed trimmed fertilized".split(),
        "A": "green leafy fragrant wild overgrown organic shady fertile dry colorful".split(),
    },
    {  # law and politics
        "N": "court judge lawyer senator election vote law bill trial verdict jury parliament policy campaign citizen treaty minister witness appeal contract crime mayor debate ballot".split(),
        "V": "voted ruled argued elected appealed sued signed vetoed testified debated campaigned passed".split(),
        "A": "legal federal fair guilty public corrupt constitutional liberal local official".split(),
    },
    {  # animals and pets
        "N": "dog cat puppy kitten horse bird parrot leash vet cage hamster rabbit fish collar barn tail paw saddle feather nest bone whisker pony herd owl".split(),
        "V": "barked chased fetched purred groomed fed galloped chirped adopted scratched wagged nested".split(),
        "A": "fluffy furry playful loyal wild hungry lazy cute noisy gentle".split(),
    },
]

# Shared function words (not topic specific).
FUNCTION = {
    "D": "the a this that my our your every some one".split(),
    "P": "in with for on about after before near under during".split(),
    "R": "i we you they she he".split(),
    "B": "really often quickly finally never always carefully suddenly barely again".split(),
}

# Sentence templates: slot letters are categories (N/V/A topical; D/P/R/B
# shared); other words are literal. Every A is directly followed by its N.
TEMPLATES: list[str] = [
    "D A N V D N .",
    "R V D A N P D N .",
    "D N V P D A N .",
    "then D N V D N .",
    "R B V D N and D A N .",
    "D A N B V P D N P D A N .",
    "R V that D N V D A N .",
    "how had R V D A N P D N ?",
    "D N and D N V B .",
    "after D N , R V D A N .",
]

_BLOCK_USERS = 2048  # users per generation block (fixed: text must not depend on batch_rows)

DEFAULTS: dict = {
    "n_users": 20000,
    "contributions_median": 8,
    "contributions_sigma": 1.2,
    "max_contributions": 512,
    "n_topics": 8,
    "alpha": 0.1,
    "public_examples": 20000,
    "public_shift": 0.5,
    "max_sentences": 3,
    "extra_sentence_prob": 0.3,
    "zipf_exponent": 1.0,
    "background_mass": 0.1,
    "collocation_prob": 0.5,
    "topic_weights": None,
    "seed": None,
}

#: A topic is rare when its weight (synthetic.topic_weights) is below this fraction of the largest weight.
RARE_TOPIC_FRACTION = 0.5


@dataclass(frozen=True)
class SyntheticSpec:
    """Validated generator settings (see config/README.md, 'datasets: synthetic and split')."""

    n_users: int
    contributions_median: float
    contributions_sigma: float
    max_contributions: int
    n_topics: int
    alpha: float
    public_examples: int
    public_shift: float
    max_sentences: int
    extra_sentence_prob: float
    zipf_exponent: float
    background_mass: float
    collocation_prob: float
    topic_weights: tuple[float, ...] | None
    seed: int

    @classmethod
    def from_config(cls, name: str, spec: dict, seed: int) -> "SyntheticSpec":
        raw = spec.get("synthetic") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"datasets.{name}.synthetic must be a mapping of generator settings, not {raw!r}.")
        unknown = sorted(set(raw) - set(DEFAULTS))
        if unknown:
            raise ConfigError(
                f"datasets.{name}.synthetic has unknown key(s) {unknown}; allowed: {sorted(DEFAULTS)}. "
                "See config/README.md, section 'datasets: synthetic and split'."
            )
        v = {**DEFAULTS, **raw}
        if v["seed"] is None:
            v["seed"] = seed

        def need(key: str, ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"datasets.{name}.synthetic.{key} is {v[key]!r}; it must be {what}.")

        for key in ("n_users", "max_contributions", "n_topics", "max_sentences"):
            need(key, isinstance(v[key], int) and not isinstance(v[key], bool) and v[key] >= 1, "an integer >= 1")
        need("public_examples", isinstance(v["public_examples"], int) and v["public_examples"] >= 0, "an integer >= 0")
        need("seed", isinstance(v["seed"], int) and v["seed"] >= 0, "an integer >= 0")
        for key in ("contributions_median", "alpha", "zipf_exponent"):
            need(key, isinstance(v[key], (int, float)) and v[key] > 0, "a number > 0")
        for key in ("contributions_sigma", "public_shift"):
            need(key, isinstance(v[key], (int, float)) and v[key] >= 0, "a number >= 0")
        for key in ("extra_sentence_prob", "background_mass", "collocation_prob"):
            need(key, isinstance(v[key], (int, float)) and 0 <= v[key] <= 1, "a number in [0, 1]")
        need("contributions_median", v["contributions_median"] <= v["max_contributions"], "at most max_contributions")
        w = v["topic_weights"]
        if w is not None:
            ok = (isinstance(w, list) and len(w) == v["n_topics"]
                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in w))
            need("topic_weights", ok, f"null or a list of n_topics ({v['n_topics']}) numbers > 0, one relative "
                 "weight per topic (e.g. [1, 1, 1, 1, 1, 1, 0.25, 0.25]: two rare topics)")
            v["topic_weights"] = tuple(float(x) for x in w)
        return cls(**{k: v[k] for k in DEFAULTS})

    def topic_prior(self) -> np.ndarray:
        """The Dirichlet parameter of the users' topic mixtures: alpha * 1, or alpha * K * w / sum(w)."""
        if self.topic_weights is None:
            return np.full(self.n_topics, float(self.alpha))
        w = np.asarray(self.topic_weights, dtype=float)
        return self.alpha * self.n_topics * w / w.sum()

    def rare_topics(self) -> list[int]:
        """Topics whose weight is below RARE_TOPIC_FRACTION of the largest (none without topic_weights)."""
        if self.topic_weights is None:
            return []
        top = max(self.topic_weights)
        return [k for k, x in enumerate(self.topic_weights) if x < RARE_TOPIC_FRACTION * top]


# ---------------------------------------------------------------- topic models


def _category_pool(cat: str) -> tuple[list[str], list[np.ndarray]]:
    """The union of theme words of category `cat`, and each theme's word indices in it."""
    pool: list[str] = []
    index: dict[str, int] = {}
    members = []
    for theme in THEMES:
        ids = []
        for w in theme[cat]:
            if w not in index:
                index[w] = len(pool)
                pool.append(w)
            ids.append(index[w])
        members.append(np.array(sorted(set(ids)), dtype=np.int64))
    return pool, members


class TopicModels:
    """Per-topic word distributions and collocations, built from one seed."""

    def __init__(self, n_topics: int, zipf_exponent: float, background_mass: float, seed: int):
        rng = np.random.default_rng(derive_seed(seed, "synthetic", "topics"))
        self.words: list[str] = []  # global vocabulary: categories concatenated
        self.offset: dict[str, int] = {}
        self.size: dict[str, int] = {}
        self.cdf: dict[str, np.ndarray] = {}  # cat -> (K, V_cat) cumulative probs
        for cat in ("N", "V", "A"):
            pool, members = _category_pool(cat)
            self.offset[cat], self.size[cat] = len(self.words), len(pool)
            self.words += pool
            p = np.full((n_topics, len(pool)), background_mass / len(pool))
            for k in range(n_topics):
                ids = rng.permutation(members[k % len(THEMES)])  # seeded Zipf ranking
                w = 1.0 / np.arange(1, len(ids) + 1) ** zipf_exponent
                p[k, ids] += (1 - background_mass) * w / w.sum()
            self.cdf[cat] = np.cumsum(p, axis=1)
            self.cdf[cat][:, -1] = 1.0
        for cat, pool in FUNCTION.items():
            self.offset[cat], self.size[cat] = len(self.words), len(pool)
            self.words += pool
        # Collocations: per topic, every noun has a preferred adjective and verb.
        n_nouns = self.size["N"]
        self.colloc = {
            cat: np.stack([self.sample_cat(rng, cat, np.full(n_nouns, k)) for k in range(n_topics)])
            for cat in ("A", "V")
        }  # (K, n_nouns) -> index within category

    def sample_cat(self, rng: np.random.Generator, cat: str, topics: np.ndarray) -> np.ndarray:
        """Draw one word index (within category) per entry of `topics`, vectorised."""
        cdf = self.cdf[cat]
        k, v = cdf.shape
        flat = (cdf + 2.0 * np.arange(k)[:, None]).ravel()  # rows in disjoint ranges
        u = rng.random(len(topics))
        idx = np.searchsorted(flat, u + 2.0 * topics, side="right") - topics * v
        return np.minimum(idx, v - 1)


def _compile_templates(models: TopicModels) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Templates as (n_templates, L) arrays of slot codes, with literal words added to the vocabulary.

    Codes: >= 0 a fixed word id (literal); -1 padding; -2.. category slots
    (see `_CATS`). The second array gives, per slot, the position of the noun
    an A (next N) or V (previous N) attaches to, or -1.
    """
    words = list(models.words)
    literal: dict[str, int] = {}
    rows = [t.split() for t in TEMPLATES]
    width = max(len(r) for r in rows)
    codes = np.full((len(rows), width), -1, dtype=np.int64)
    heads = np.full((len(rows), width), -1, dtype=np.int64)
    for i, toks in enumerate(rows):
        for j, tok in enumerate(toks):
            if tok in _CATS:
                codes[i, j] = -2 - _CATS.index(tok)
                if tok == "A":
                    heads[i, j] = j + 1
                elif tok == "V":
                    prev = [p for p in range(j) if toks[p] == "N"]
                    heads[i, j] = prev[-1] if prev else -1
            else:
                if tok not in literal:
                    literal[tok] = len(words)
                    words.append(tok)
                codes[i, j] = literal[tok]
    return codes, heads, words


_CATS = ["N", "V", "A", "D", "P", "R", "B"]


def _generate_texts(
    models: TopicModels,
    topics: np.ndarray,
    rng: np.random.Generator,
    max_sentences: int,
    extra_sentence_prob: float,
    collocation_prob: float,
) -> pa.Array:
    """One text per entry of `topics` (all its sentences from that topic)."""
    codes, heads, words = _compile_templates(models)
    n = len(topics)
    n_sent = 1 + rng.binomial(max_sentences - 1, extra_sentence_prob, size=n) if max_sentences > 1 else np.ones(n, np.int64)
    s_topic = np.repeat(topics, n_sent)
    tmpl = rng.integers(0, len(codes), size=len(s_topic))
    slot = codes[tmpl]  # (S, L)
    head = heads[tmpl]
    ids = np.where(slot >= 0, slot, -1)
    rows, cols = np.nonzero(slot <= -2)
    cat_of = -2 - slot[rows, cols]
    # Nouns first (_CATS order): adjectives and verbs may attach to them.
    for c in range(len(_CATS)):
        sel = cat_of == c
        r, col = rows[sel], cols[sel]
        cat = _CATS[c]
        if cat in ("N", "V", "A"):
            w = models.sample_cat(rng, cat, s_topic[r])
            if cat in ("V", "A"):
                h = head[r, col]
                attach = (h >= 0) & (rng.random(len(r)) < collocation_prob)
                noun = ids[r[attach], h[attach]] - models.offset["N"]
                w[attach] = models.colloc[cat][s_topic[r[attach]], noun]
            ids[r, col] = models.offset[cat] + w
        else:
            ids[r, col] = models.offset[cat] + rng.integers(0, models.size[cat], size=len(r))
    vocab = pa.array(words, pa.string())
    valid = ids >= 0
    flat_ids = ids[valid]
    lengths = valid.sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    sentences = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), vocab.take(pa.array(flat_ids))), " ")
    ex_off = np.concatenate([[0], np.cumsum(n_sent)]).astype(np.int32)
    return pc.binary_join(pa.ListArray.from_arrays(pa.array(ex_off), sentences), " ")


# ---------------------------------------------------------------- users


def contribution_counts(n_users: int, median: float, sigma: float, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Discretised log-normal counts: round(exp(N(log median, sigma))), clipped to [1, cap]."""
    x = np.exp(rng.normal(np.log(median), sigma, size=n_users))
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def public_topic_weights(n_topics: int, shift: float) -> np.ndarray:
    """Shifted global topic mixture of the public corpus: proportional to exp(-shift * k)."""
    w = np.exp(-shift * np.arange(n_topics))
    return w / w.sum()


class SyntheticSource:
    """`Source` of the synthetic corpus; see the module docstring."""

    def __init__(self, name: str, spec: dict, data_dir: Path, seed: int):
        check_keys(name, spec, source_keys("synthetic"))
        self.name, self.spec, self.data_dir = name, spec, Path(data_dir)
        self.params = SyntheticSpec.from_config(name, spec, seed)
        self.max_examples = max_examples(name, spec)
        p = self.params
        self.models = TopicModels(p.n_topics, p.zipf_exponent, p.background_mass, p.seed)
        rng = np.random.default_rng(derive_seed(p.seed, "synthetic", "users"))
        self.n_examples = contribution_counts(p.n_users, p.contributions_median, p.contributions_sigma, p.max_contributions, rng)
        # theta_u ~ Dirichlet(alpha * 1) (or the topic_weights prior). numpy's Dirichlet underflows to NaN
        # for very small alpha; normalised Gamma draws with a floor do not.
        shape = p.alpha if p.topic_weights is None else p.topic_prior()  # a scalar keeps the uniform draws as before
        g = rng.standard_gamma(shape, size=(p.n_users, p.n_topics))
        g[np.arange(p.n_users), np.argmax(g, axis=1)] += 1e-300
        self.theta = g / g.sum(axis=1, keepdims=True)

    # -- Source interface
    def download(self) -> None:
        """Nothing to fetch: the corpus is generated."""

    def has_public(self) -> bool:
        return self.params.public_examples > 0

    def user_labels(self, batch_rows: int = 10_000) -> pa.Table:
        """Each user's topic group: "rare" if the user's main topic (argmax theta_u) is a rare topic of
        `topic_weights` (SyntheticSpec.rare_topics), else "common" (kind "topic"; userdp.evaluation.groups)."""
        rare = np.isin(np.argmax(self.theta, axis=1), self.params.rare_topics())
        labels = np.where(rare, "rare", "common")
        n = self.params.n_users
        return pa.table({"user_id": self.user_ids(0, n), "kind": pa.array(["topic"] * n, pa.string()),
                         "label": pa.array(labels.tolist(), pa.string())})

    def user_ids(self, start: int, stop: int) -> pa.Array:
        width = max(6, len(str(self.params.n_users - 1)))
        return pa.array([f"u{i:0{width}d}" for i in range(start, stop)], pa.string())

    def generate_block(self, block: int) -> pa.Table:
        """Examples of users [block * B, (block + 1) * B): user_id, text and the latent topic."""
        p = self.params
        lo, hi = block * _BLOCK_USERS, min((block + 1) * _BLOCK_USERS, p.n_users)
        rng = np.random.default_rng(derive_seed(p.seed, "synthetic", "block", block))
        counts = self.n_examples[lo:hi]
        user = np.repeat(np.arange(hi - lo), counts)
        # Example topic z ~ theta_u by inverse CDF per row.
        cdf = np.cumsum(self.theta[lo:hi], axis=1)
        u = rng.random(len(user))
        topic = np.minimum((u[:, None] > cdf[user]).sum(axis=1), p.n_topics - 1)
        text = _generate_texts(self.models, topic, rng, p.max_sentences, p.extra_sentence_prob, p.collocation_prob)
        uid = self.user_ids(lo, hi).take(pa.array(user))
        return pa.table({"user_id": uid, "text": text, "topic": pa.array(topic.astype(np.int32))})

    def iter_batches(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        n_blocks = -(-self.params.n_users // _BLOCK_USERS)
        left = self.max_examples
        for b in range(n_blocks):
            t = self.generate_block(b)
            t = t.select(["user_id", "text"]).append_column(
                "source_split", pa.nulls(t.num_rows, pa.string())
            ).cast(RAW_SCHEMA)
            if left is not None:
                t = t.slice(0, left)
                left -= t.num_rows
            yield from t.to_batches(max_chunksize=batch_rows)
            if left is not None and left <= 0:
                return

    def public_topics(self, n: int, rng: np.random.Generator) -> np.ndarray:
        w = public_topic_weights(self.params.n_topics, self.params.public_shift)
        return rng.choice(self.params.n_topics, size=n, p=w)

    def iter_public(self, batch_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
        p = self.params
        chunk = _BLOCK_USERS * 8
        for i, lo in enumerate(range(0, p.public_examples, chunk)):
            n = min(chunk, p.public_examples - lo)
            rng = np.random.default_rng(derive_seed(p.seed, "synthetic", "public", i))
            text = _generate_texts(self.models, self.public_topics(n, rng), rng, p.max_sentences, p.extra_sentence_prob, p.collocation_prob)
            yield from pa.table({"text": text}, schema=PUBLIC_SCHEMA).to_batches(max_chunksize=batch_rows)
