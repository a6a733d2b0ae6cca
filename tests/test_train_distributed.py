"""Data-parallel training (2 gloo processes on CPU) runs the mechanism of one process.

The same seeds give the same parameters (float64 model; only the summation
order differs, so equality is to rtol 1e-10), the same train log and the same
ledger; noise is added once (std sigma C, the very draws of one process); a
checkpoint written by 2 processes resumes in 1; the torchrun launcher of
rule finetune produces the outputs of an in-process job; and the same spawn
runs the two-process case of the neighbouring-dataset replay
(tests/test_replay_neighbouring.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from test_replay_neighbouring import check_two_process_replay, two_process_records
from train_fixtures import SEQ, ConstantGradients, plan_for, tiny_model, tokens_table
from userdp.io import read_json
from userdp.seeding import derive_seed
from userdp.training import distributed, engine, run_seeds, run_state
from userdp.training.pool import build_pool
from userdp.training.settings import TrainSettings

WORLD = 2
T = 4
SIGMA, CLIP = 0.7, 0.5
E_NOISE = 4.0

# The ledger fields that describe the mechanism and the realised compute.
LEDGER_KEYS = ["method", "sampling_rate", "noise_multiplier", "clip_norm", "clipping", "group_size", "delta",
               "accountant", "epsilon", "steps_completed", "complete", "expected_batch", "examples_processed",
               "users_processed", "compute_ratio", "seeds", "resumed_at_steps", "n_pool_examples"]


def fake_epsilon(event, delta):
    """A fast stand-in for the accountant ((event, delta) -> epsilon) where epsilon's value is not under test."""
    return 1.0 + event.count * 1e-3 if hasattr(event, "count") else 1.0


def make_pool(G: int):
    t = tokens_table(40, seed=3)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    return build_pool(train, G, seed=0)


def settings(**kw):
    base = dict(learning_rate=1e-2, optimizer="adam", schedule="cosine", warmup_steps=1, physical_batch_size=2,
                sequence_length=SEQ, checkpoint_every=2, device="cpu", log_every_s=1e9,
                debug_step_log=True)  # every per-step column written, to compare them with one process
    base.update(kw)
    return TrainSettings(**base)


def run_case(name: str, root: Path, dist=None, **kw) -> tuple[torch.Tensor, engine.TrainOutcome]:
    """One training run of case `name` into root/name; returns the final parameters and the outcome."""
    if name in ("els", "resume"):
        pool, method = make_pool(2), "els"
        plan, s, source = plan_for(pool, "els", expected=6.0, steps=T, sigma=SIGMA, clip=CLIP), settings(), None
    elif name in ("uls", "uls_adaptive", "uls_banded"):
        pool, method = make_pool(3), "uls"
        plan = plan_for(pool, "uls", expected=4.0, steps=T, sigma=SIGMA, clip=CLIP)
        if name != "uls":  # the count's noise drawn once on rank 0, every rank moving C alike
            plan = plan.replace(clipping="adaptive",
                                adaptive_clipping={"quantile": 0.5, "learning_rate": 0.5, "count_noise": 0.3})
        if name == "uls_banded":  # banded DP-FTRL with adaptive clipping and AdamBC: buffers on rank 0 only, and
            # AdamBC's subtracted variance (the step's marginal std) alike on every rank
            plan = plan.replace(sampling_rate=plan.sampling_rate * 2, correlated_noise={"bands": 2})
        s, source = settings(physical_batch_size=4, optimizer="adam_bc" if name == "uls_banded" else "adam"), None
    elif name == "noise":  # zero gradients: the update is the noise alone
        pool, method = make_pool(2), "els"
        plan = plan_for(pool, "els", expected=E_NOISE, steps=1, sigma=2.0, clip=CLIP)
        s = settings(optimizer="sgd", schedule="constant", warmup_steps=0, learning_rate=1.0, physical_batch_size=1)
        source = lambda m, c, normalize=False: ConstantGradients(m, c, value=0.0)  # noqa: E731
    else:
        raise ValueError(name)
    model = tiny_model(seed=1).double()
    seeds = run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, pool.group_size)
    out = engine.train(model, pool, plan, s, run_state.RunPaths(root / name), seeds, 0, gradient_source=source,
                       compute_epsilon=fake_epsilon, dist=dist, **kw)
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]), out


def _worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    root = Path(root)
    torch_dist.init_process_group("gloo", init_method=f"file://{root / 'pg_store'}", rank=rank, world_size=world)
    try:
        ctx = distributed.current_context()  # also checks the engine's auto-detection path
        assert ctx is not None and ctx.world_size == world and ctx.rank == rank
        results = {}
        for name in ("els", "uls", "uls_adaptive", "uls_banded", "noise"):
            params, out = run_case(name, root / "dist")  # dist=None: detected from the process group
            results[name] = {"params": params, "log": out.log, "ledger": out.ledger, "complete": out.complete}
        params, out = run_case("resume", root / "dist", max_steps=2)
        results["resume_stop"] = {"params": params, "complete": out.complete}
        # privacy.secret_seeds: rank 0's fresh entropy must reach every rank (same Poisson sample everywhere)
        secret = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 100, 3, 0.01, secret=True)
        results["secret_seeds"] = run_seeds.draw_secret_seeds(secret, ctx, torch.device("cpu"))
        # the neighbouring-dataset replay's two-process case (tests/test_replay_neighbouring.py), in this spawn
        results["replay"] = two_process_records(root / "replay" / f"rank{rank}")
        torch.save(results, root / f"rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process runs (one spawn for every case) and the matching 1-process runs."""
    root = tmp_path_factory.mktemp("dp")
    mp.spawn(_worker, args=(WORLD, str(root)), nprocs=WORLD, join=True)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    single = {name: run_case(name, root / "single") for name in ("els", "uls", "uls_adaptive", "uls_banded", "noise")}
    return root, ranks, single


@pytest.mark.integration
@pytest.mark.parametrize("name", ["els", "uls", "uls_adaptive", "uls_banded"])
def test_two_processes_match_one(runs, name):
    root, ranks, single = runs
    ref_params, ref = single[name]
    # every replica holds bitwise the same parameters
    assert torch.equal(ranks[0][name]["params"], ranks[1][name]["params"])
    params = ranks[0][name]["params"]
    before = torch.cat([p.detach().reshape(-1) for p in tiny_model(seed=1).double().parameters()])
    assert float((ref_params - before).abs().max()) > 1e-3  # training did move the parameters
    # AdamBC's v - phi cancels to near its floor, which magnifies the ranks' other summation order (seen: 6e-12)
    torch.testing.assert_close(params, ref_params, rtol=1e-10, atol=1e-10 if name == "uls_banded" else 1e-12)

    # the written ledger equals the one-process ledger on the mechanism and compute; processes recorded
    ledger = read_json(root / "dist" / name / "ledger.json")
    ref_ledger = read_json(root / "single" / name / "ledger.json")
    assert {k: ledger[k] for k in LEDGER_KEYS} == {k: ref_ledger[k] for k in LEDGER_KEYS}
    assert ledger["processes"] == WORLD and ref_ledger["processes"] == 1
    assert ranks[1][name]["ledger"] == ranks[0][name]["ledger"]  # rank 0's ledger reaches every rank

    # same sampled batches, same statistics (loss and norms summed over ranks)
    log = pd.read_parquet(root / "dist" / name / "train_log.parquet")
    exact = ["step", "realised_examples", "realised_users", "realised_units", "examples_processed", "learning_rate"]
    pd.testing.assert_frame_equal(log[exact], ref.log[exact])
    cols = ["loss", "clipped_fraction", "mean_unit_norm", "update_norm", "update_signal_norm"]
    if name in ("uls_adaptive", "uls_banded"):
        cols += ["clip_norm", "unclipped_fraction_noisy"]
        assert ledger["adaptive_clipping"] == ref_ledger["adaptive_clipping"]
        assert log["clip_norm"].nunique() == T
    for col in cols:
        np.testing.assert_allclose(log[col], ref.log[col], rtol=1e-10)
    assert log["realised_units"].sum() > T  # several micro-batches per step, so both ranks had work
    assert not (root / "dist" / name / "checkpoint").exists()


@pytest.mark.integration
def test_noise_added_once_with_std_sigma_c(runs):
    root, ranks, single = runs
    before = torch.cat([p.detach().reshape(-1) for p in tiny_model(seed=1).double().parameters()])
    ref_params, _ = single["noise"]
    params = ranks[0]["noise"]["params"]
    # zero gradients, SGD lr 1: params - before = -noise / E, the same draws as one process
    torch.testing.assert_close(params, ref_params, rtol=1e-12, atol=1e-12)
    noise = (before - params) * E_NOISE
    std = 2.0 * CLIP
    n = noise.numel()
    assert abs(float(noise.std()) / std - 1) < 5 / math.sqrt(2 * n)  # twice the noise would be sqrt(2) std
    assert abs(float(noise.mean())) < 5 * std / math.sqrt(n)


@pytest.mark.integration
def test_neighbouring_replay_with_two_processes(runs):
    """Invariant 7 (docs/method.md section 11) with two processes: on D and D minus the largest user the
    other units and the noise are the same and the clipped sums differ by at most k_t C at every step."""
    root, ranks, _ = runs
    check_two_process_replay([r["replay"] for r in ranks], root / "replay" / "single")


@pytest.mark.integration
def test_checkpoint_of_two_processes_resumes_in_one(runs):
    root, ranks, single = runs
    assert not ranks[0]["resume_stop"]["complete"] and not ranks[1]["resume_stop"]["complete"]
    run_dir = root / "dist" / "resume"
    assert (run_dir / "checkpoint" / "state.pt").exists() and not (run_dir / "ledger.json").exists()
    params, out = run_case("resume", root / "dist")  # one process picks up the 2-process checkpoint
    assert out.complete and out.ledger["resumed_at_steps"] == [2]
    torch.testing.assert_close(params, single["els"][0], rtol=1e-10, atol=1e-12)
    assert out.ledger["examples_processed"] == single["els"][1].ledger["examples_processed"]


def test_micro_batch_shares_partition_the_step():
    items = list(range(7))
    shares = [distributed.my_share(items, distributed.DistContext(r, 3, r)) for r in range(3)]
    assert sorted(sum(shares, [])) == items and shares[0] == [0, 3, 6]
    assert distributed.my_share(items, None) == items
    cmd = distributed.torchrun_command(4, "userdp.training.finetune_job", ["--job", "x.json"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert cmd[-3:] == ["userdp.training.finetune_job", "--job", "x.json"]


@pytest.mark.integration
def test_torchrun_launcher_matches_in_process_job(tmp_path):
    """finetune_job.launch with 2 processes (torchrun, gloo on CPU) = the same job in this process."""
    from train_fixtures import make_tokenizer

    from userdp.config import validate_config
    from userdp.training import finetune_job
    from userdp.training.models import build_model, special_ids, load_tokenizer

    vocab = make_tokenizer(tmp_path / "tokenizer")
    tokens = tokens_table(40, seed=5, vocab=vocab, max_len=SEQ)
    pq.write_table(tokens, tmp_path / "tokens.parquet")
    ids = special_ids(load_tokenizer(tmp_path / "tokenizer"))
    build_model({"n_layer": 1, "n_embd": 16, "n_head": 2}, vocab, SEQ, ids, seed=0).save_pretrained(tmp_path / "base")
    train = tokens.filter(pc.equal(tokens["split"], "train")).select(["user_id", "example_id", "input_ids"])
    bounded = build_pool(train, 2, derive_seed(0, "tiny", 0, 2, "bounding"))  # the job's own bounding
    plan = plan_for(bounded, "els", expected=6.0, steps=3, sigma=SIGMA, clip=CLIP)
    plan.write(tmp_path / "plan.json")
    config = validate_config({
        "seed": 0, "datasets": {"tiny": {"source": "synthetic"}},
        "tokenizer": {"sequence_length": SEQ, "public_dataset": "tiny"},
        "training": {"physical_batch_size": 2, "checkpoint_every": 2, "device": "cpu", "threads": 2},
    })

    def job(name: str) -> finetune_job.FinetuneJob:
        return finetune_job.FinetuneJob(
            config=config, plan=str(tmp_path / "plan.json"), tokens=str(tmp_path / "tokens.parquet"),
            tokenizer=str(tmp_path / "tokenizer" / "tokenizer.json"), model=str(tmp_path / "base"),
            run_dir=str(tmp_path / name), learning_rate=1e-2, dataset="tiny", method="els", eps="8", budget="18",
            seed=0, threads=2, log=str(tmp_path / f"{name}.log"),
        )

    (tmp_path / "two.log").write_text("")
    finetune_job.launch(job("two"), processes=2)
    finetune_job.launch(job("one"), processes=1)
    a, b = read_json(tmp_path / "two" / "ledger.json"), read_json(tmp_path / "one" / "ledger.json")
    assert a["processes"] == 2 and b["processes"] == 1
    assert {k: a[k] for k in LEDGER_KEYS} == {k: b[k] for k in LEDGER_KEYS}
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "two/model/model.safetensors"), load_file(tmp_path / "one/model/model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:  # float32 model: summation order differs only in the last bits
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    text = (tmp_path / "two.log").read_text()
    assert "[rank 0]" in text and "processes=2" in text and "run complete: 3 steps" in text
    assert "[rank 1]" not in text  # other ranks log errors only
    assert "differs from q * N" not in text
    assert not list((tmp_path / "two").glob(".finetune-job-*"))  # the job file is removed


@pytest.mark.integration
def test_secret_seeds_are_the_same_on_every_rank(runs):
    root, ranks, single = runs
    a, b = ranks[0]["secret_seeds"], ranks[1]["secret_seeds"]
    assert a == b and a["secret"] is True
    public = run_seeds.run_seeds(0, 0, "tiny", "uls", "8", 100, 3, 0.01)
    assert a["sampler"] != public["sampler"] and a["noise"] != public["noise"]  # fresh, not config-derived
