"""Builders of small inputs for the evaluation tests (not collected by pytest).

- `tiny_gpt2`: a real GPT-2 built from a config, saved with save_pretrained.
- `tokens_table`: a tokens.parquet in the data stage's schema.
- `fake_summary` / `fake_curves`: realistic summary tables for the figures.
- `plan_record`: a complete plan (a privacy.spec.RunSpec record) for cells whose plan is only read.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

VOCAB = 61
BOS = 1


def plan_record(method: str, epsilon: float, *, group_size: int = 4, steps: int = 5, delta: float = 1e-5,
                noise_multiplier: float | None = None, **fields) -> dict:
    """A complete, valid plan record of a cell (non-private when epsilon is inf), with `fields` on top."""
    from userdp.privacy.spec import RunSpec

    private = not math.isinf(float(epsilon))
    sigma = (1.5 if private else 0.0) if noise_multiplier is None else float(noise_multiplier)
    spec = RunSpec(dataset="toy", method=method, epsilon=float(epsilon), delta=delta, group_size=int(group_size),
                   sampling_rate=0.1, steps=int(steps), expected_batch=4.0, noise_multiplier=sigma,
                   clip_norm=1.0 if sigma > 0 else None, clipping="flat" if sigma > 0 else None)
    return spec.replace(**fields).to_record()


def tiny_gpt2(path: str | Path | None = None, seed: int = 0, n_positions: int = 32):
    """A 1-layer GPT-2 with random weights; saved to `path` when given."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=16, n_layer=1, n_head=2,
                     bos_token_id=BOS, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    if path is not None:
        model.save_pretrained(str(path))
    return model


def tokens_table(path: str | Path, n_users: dict[str, int] | None = None, seed: int = 0, max_len: int = 12) -> pd.DataFrame:
    """Write a tokens.parquet with users in each split and rows of varied length (some bos-only)."""
    rng = np.random.default_rng(seed)
    n_users = n_users or {"train": 6, "validation": 4, "test": 5}
    rows = []
    ex = 0
    for split, n in n_users.items():
        for u in range(n):
            for _ in range(int(rng.integers(1, 5))):
                length = int(rng.integers(1, max_len + 1))
                ids = [BOS] + rng.integers(3, VOCAB, size=length - 1).tolist()
                rows.append({"user_id": f"{split[:2]}{u}", "example_id": ex, "split": split,
                             "input_ids": ids, "n_tokens": length})
                ex += 1
    df = pd.DataFrame(rows)
    schema = pa.schema([("user_id", pa.string()), ("example_id", pa.int64()), ("split", pa.string()),
                        ("input_ids", pa.list_(pa.int32())), ("n_tokens", pa.int64())])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(df, schema=schema, preserve_index=False), path)
    return df


def _loss(method: str, eps: float, budget: int, g: int | None, seed: int, rng) -> float:
    """A plausible test loss: falls with compute, privacy costs more at small eps."""
    base = 4.6 - 0.35 * math.log10(budget / 4000)
    if math.isinf(eps):
        pen = 0.0
    else:
        # ULS pays less at small eps and large compute; ELS wins slightly at small compute.
        k = 1.3 if method == "els" else 0.9 + 0.3 * (8000 / budget)
        pen = k / math.sqrt(eps)
    if g is not None:
        best = 8 if method == "els" else 16
        pen += 0.08 * (math.log2(g) - math.log2(best)) ** 2
    return base + pen + rng.normal(0, 0.02)


def fake_summary(
    epsilons=(1, 2, 4, 8), budgets=((8000, 50), (32000, 100), (128000, 200)), seeds=(0, 1),
    sweep=(1, 2, 4, 8, 16, 32, 64), heuristic=None, dataset: str = "synth",
) -> pd.DataFrame:
    """Summary rows as `aggregate` writes them (the columns the figures use, plus some plan fields)."""
    rng = np.random.default_rng(0)
    heuristic = heuristic or {"els": 8, "uls": 32}
    rows = []
    for method in ("els", "uls"):
        for eps in list(epsilons) + [math.inf]:
            for budget, steps in budgets:
                for seed in seeds:
                    g = heuristic[method]
                    rows.append(dict(dataset=dataset, method=method, epsilon=float(eps), budget=budget, steps=steps,
                                     seed=seed, group_size=g, is_group_sweep=False,
                                     test_loss=_loss(method, eps, budget, g, seed, rng), plan_delta=1.1e-5))
        for g in sweep:
            for seed in seeds:
                budget, steps = budgets[0]
                rows.append(dict(dataset=dataset, method=method, epsilon=float(epsilons[0]), budget=budget,
                                 steps=steps, seed=seed, group_size=g, is_group_sweep=True,
                                 test_loss=_loss(method, epsilons[0], budget, g, seed, rng), plan_delta=1.1e-5))
    return pd.DataFrame(rows)


def fake_curves(summary: pd.DataFrame) -> pd.DataFrame:
    """Per-step training losses for every summary row, noisy and decreasing."""
    rng = np.random.default_rng(1)
    parts = []
    for _, r in summary.iterrows():
        steps = np.arange(1, int(r["steps"]) + 1)
        final = r["test_loss"] - 0.05
        loss = final + (6.0 - final) * np.exp(-steps / (0.25 * len(steps))) + rng.normal(0, 0.1, len(steps))
        parts.append(pd.DataFrame({
            "dataset": r["dataset"], "method": r["method"], "epsilon": r["epsilon"], "budget": r["budget"],
            "seed": r["seed"], "group_size": r["group_size"], "is_group_sweep": r["is_group_sweep"],
            "learning_rate": 1e-3, "step": steps, "loss": loss,
        }))
    return pd.concat(parts, ignore_index=True)
