"""Neighbouring-dataset replay of the real engine (docs/method.md section 11, invariant 7).

`engine.train` runs on D and on D minus one user u with the same seeds and
records every step through its observation hook (`observe`: the sampled
units, the clipped sum before noise, the noise). At every step:

* the other users' sampled units are the same units (by identity: user id,
  and for ELS the row's rank among the user's bounded rows);
* the noise is bitwise the same;
* ||S(D) - S(D - u)|| <= k_t C for ELS, with k_t <= G the number of u's
  examples sampled at step t, and <= C for ULS (u sampled or not); when u is
  not sampled the two sums are equal (to float64 rounding: the micro-batches
  are packed differently).

Cases: ELS and ULS, flat and normalized clipping, u = the largest user (n_u
> G, bounded to G), a user with one example, a user with exactly G examples;
ULS with `uls_examples_per_user` (per-user row subsets); and one case with
two processes (gloo on CPU), whose observations also equal the one-process
ones (run inside tests/test_train_distributed.py's process group, see the
end of this file). This is the class of glue-code bugs (sampling that shifts when a user
is removed, a unit split across micro-batches, noise drawn from a stream
that depends on the data) that brute-force checks of one step cannot see.

The learning rate is 0, so both runs evaluate every step at the same
parameters: the per-step sensitivity is what the accountant composes
(conditioned on the same history), while with a non-zero rate the two
models drift apart after the first step in which u is sampled and every
user's gradient differs. Float64 model, so tolerances are float64 rounding.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from train_fixtures import SEQ, plan_for, tiny_model, tokens_table
from userdp.training import engine, run_seeds, run_state, step
from userdp.training.pool import build_pool
from userdp.training.settings import TrainSettings

G, T, CLIP, SIGMA = 4, 6, 0.05, 0.7
RATE = {"els": 0.25, "uls": 0.3}  # the same q on D and on D - u: one mechanism, two datasets
TOL = 1e-9


def _epsilon(event, delta):  # the ledger's accountant is not under test here
    return 1.0


@functools.lru_cache(maxsize=None)
def _train_table() -> pa.Table:
    t = tokens_table(40, seed=5)
    return t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])


def _counts() -> dict[str, int]:
    users = _train_table()["user_id"].to_pylist()
    return {u: users.count(u) for u in sorted(set(users))}


def victim(which: str) -> str:
    """The removed user: the largest one, the first with one example, the first with exactly G."""
    counts = _counts()
    if which == "largest":
        return max(counts, key=lambda u: (counts[u], u))
    return next(u for u, n in counts.items() if n == {"one": 1, "G": G}[which])


@functools.lru_cache(maxsize=None)
def pool_for(removed: str | None):
    """The bounded pool of D (removed=None) or of D minus that user, numbered contiguously as prepare does."""
    train = _train_table()
    if removed is not None:
        train = train.filter(pc.not_equal(train["user_id"], removed))
        train = train.set_column(1, "example_id", pa.array(np.arange(train.num_rows), pa.int64()))
    return build_pool(train, G, seed=0)


def _identities(pool, sel) -> list[tuple[str, int]]:
    """(user id, rank among the user's bounded rows) of every sampled row, in selection order."""
    users = pool.example_user[sel.rows]
    return [(pool.user_ids[u], int(r - pool.user_offsets[u])) for u, r in zip(users, sel.rows)]


def replay(method: str, clipping: str, removed: str | None, root: Path, per_user: int | None = None) -> list[dict]:
    """Run the engine on D or D - removed; one record per step (identities, flat clipped sum, flat noise)."""
    pool = pool_for(removed)
    # q and the plan are D's: the same mechanism runs on both datasets (only expected_batch warns on D - u)
    plan = plan_for(pool_for(None), method, expected=1.0, steps=T, sigma=SIGMA, clip=CLIP)
    plan = plan.replace(sampling_rate=RATE[method], clipping=clipping)
    settings = TrainSettings(learning_rate=0.0, optimizer="sgd", schedule="constant", warmup_steps=0,
                             physical_batch_size=8, sequence_length=SEQ, checkpoint_every=1000, device="cpu",
                             log_every_s=1e9, uls_examples_per_user=per_user)
    records: list[dict] = []

    def observe(o: step.StepObservation) -> None:
        records.append({
            "step": o.step,
            "units": _identities(pool, o.selection),
            "users": sorted({pool.user_ids[u] for u in pool.example_user[o.selection.rows]}),
            "clipped": torch.cat([t.reshape(-1) for t in o.clipped_sum]),
            "noise": None if o.noise is None else torch.cat([t.reshape(-1) for t in o.noise]),
            "nonfinite": o.nonfinite_units,
        })

    seeds = run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, G)  # the same seeds for D and D - u
    out = engine.train(tiny_model(seed=1).double(), pool, plan, settings,
                       run_state.RunPaths(root / f"{method}-{clipping}-{removed}-{per_user}"), seeds, 0,
                       compute_epsilon=_epsilon, observe=observe)
    assert out.complete and len(records) == T
    return records


def check_neighbours(full: list[dict], less: list[dict], u: str, method: str, clipping: str) -> None:
    """Invariant 7 at every step; also that the replay saw steps with and without u."""
    sampled_steps = 0
    for a, b in zip(full, less):
        assert a["step"] == b["step"]
        assert [x for x in a["units"] if x[0] != u] == b["units"]  # the other users' units, unit by unit
        assert torch.equal(a["noise"], b["noise"])  # bitwise the same noise
        assert a["nonfinite"] == b["nonfinite"] == 0
        k = sum(1 for x in a["units"] if x[0] == u)
        assert k <= G
        bound = (k if method == "els" else min(k, 1)) * CLIP
        diff = float(torch.linalg.vector_norm(a["clipped"] - b["clipped"]))
        scale = max(1.0, float(torch.linalg.vector_norm(a["clipped"])))
        assert diff <= bound * (1 + TOL) + TOL * scale, (a["step"], k, diff, bound)
        if k:
            sampled_steps += 1
            # u's contribution is really there; normalized clipping gives each unit norm exactly C
            assert diff > 0.5 * CLIP if clipping == "normalized" or method == "uls" else diff > 0
    assert 0 < sampled_steps < T, "the replay must see steps with and without u; change RATE or T"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("replay")


@functools.lru_cache(maxsize=None)
def _full(method: str, clipping: str, root: Path, per_user: int | None = None) -> list[dict]:
    return replay(method, clipping, None, root, per_user)


@pytest.mark.parametrize("which", ["largest", "one", "G"])
@pytest.mark.parametrize("method,clipping", [("els", "flat"), ("els", "normalized"), ("uls", "flat"),
                                             ("uls", "normalized")])
def test_step_differs_only_in_the_removed_users_units(root, method, clipping, which):
    u = victim(which)
    assert pool_for(None).n_users == pool_for(u).n_users + 1
    check_neighbours(_full(method, clipping, root), replay(method, clipping, u, root), u, method, clipping)


def test_uls_row_subsets_are_per_user(root):
    """uls_examples_per_user = 2 < G: each user's k-of-m row choice must not depend on the others."""
    u = victim("largest")
    full = _full("uls", "flat", root, 2)
    check_neighbours(full, replay("uls", "flat", u, root, 2), u, "uls", "flat")
    assert any(sum(1 for x in r["units"] if x[0] == u) == 2 for r in full)  # u really was subsampled


# ------------------------------------------------------------ two processes
#
# Starting two gloo processes costs more than everything above (each imports torch and transformers), so
# this case rides on the one spawn of tests/test_train_distributed.py: its worker calls
# `two_process_records` on every rank and its test_neighbouring_replay_with_two_processes calls
# `check_two_process_replay` on what the ranks returned.

TWO_PROCESS_CASE = ("els", "flat", "largest")


def two_process_records(root: Path) -> dict[str, list[dict]]:
    """On one rank of an initialised 2-process group: the replay of TWO_PROCESS_CASE on D and on D - u."""
    method, clipping, which = TWO_PROCESS_CASE
    u = victim(which)
    return {"full": replay(method, clipping, None, root), "less": replay(method, clipping, u, root)}


def check_two_process_replay(ranks: list[dict[str, list[dict]]], root: Path) -> None:
    """The same invariant with two processes: the clipped sums summed over ranks (equal on every rank),
    the noise drawn by rank 0 alone, and the very units, noise and (to float64 rounding) sums of one process."""
    method, clipping, which = TWO_PROCESS_CASE
    u = victim(which)
    check_neighbours(ranks[0]["full"], ranks[0]["less"], u, method, clipping)
    one = {"full": replay(method, clipping, None, root), "less": replay(method, clipping, u, root)}
    for key in ("full", "less"):
        for r0, r1, single in zip(ranks[0][key], ranks[1][key], one[key], strict=True):
            assert r1["noise"] is None  # only rank 0 draws noise
            assert r0["units"] == r1["units"] == single["units"]
            assert torch.equal(r0["clipped"], r1["clipped"])  # the all-reduced sum, on every rank
            assert torch.equal(r0["noise"], single["noise"])
            torch.testing.assert_close(r0["clipped"], single["clipped"], rtol=1e-10, atol=1e-12)
    # both ranks had work: steps with more units than one micro-batch holds
    assert max(len(r["units"]) for r in ranks[0]["full"]) > 8
