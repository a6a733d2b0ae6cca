"""Small builders shared by the training tests: tokens tables, tiny models, a reference gradient source."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch

from userdp.privacy.spec import RunSpec
from userdp.training.gradients import MicroBatchStats

torch.set_num_threads(1)  # tests share 2 cores; tiny models gain nothing from more

VOCAB = 40
SEQ = 12


def tokens_table(n_users: int = 30, seed: int = 0, median: float = 4.0, max_len: int = SEQ,
                 splits: tuple[float, float] = (0.2, 0.1), vocab: int = VOCAB) -> pa.Table:
    """A tokens.parquet-shaped table: heavy-tailed examples per user, user-level splits."""
    rng = np.random.default_rng(seed)
    counts = np.maximum(1, np.round(rng.lognormal(np.log(median), 1.0, n_users))).astype(int)
    order = rng.permutation(n_users)
    n_val, n_test = int(splits[0] * n_users), int(splits[1] * n_users)
    split = np.array(["train"] * n_users, dtype=object)
    split[order[:n_val]] = "validation"
    split[order[n_val:n_val + n_test]] = "test"
    rows = {"user_id": [], "example_id": [], "split": [], "input_ids": [], "n_tokens": []}
    ex = 0
    for u in range(n_users):
        for _ in range(counts[u]):
            n = int(rng.integers(3, max_len + 1))
            ids = [1] + rng.integers(4, vocab, size=n - 2).tolist() + [2]
            rows["user_id"].append(f"u{u:04d}")
            rows["example_id"].append(ex)
            rows["split"].append(split[u])
            rows["input_ids"].append(ids)
            rows["n_tokens"].append(n)
            ex += 1
    return pa.table({
        "user_id": pa.array(rows["user_id"], pa.string()),
        "example_id": pa.array(rows["example_id"], pa.int64()),
        "split": pa.array(rows["split"], pa.string()),
        "input_ids": pa.array(rows["input_ids"], pa.list_(pa.int32())),
        "n_tokens": pa.array(rows["n_tokens"], pa.int32()),
    })


def tiny_model(arch: str = "gpt2", tie: bool = True, seed: int = 0) -> torch.nn.Module:
    from userdp.training.models import build_model

    cfg = {"architecture": arch, "n_layer": 1, "n_embd": 16, "n_head": 2, "tie_embeddings": tie}
    return build_model(cfg, VOCAB, SEQ, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, seed=seed)


class LoopGradients:
    """Brute-force gradient source with ClippedGradients' API: one backward per row.

    Adds sum_u clip(sum_{rows r of u} w_r * grad(mean-token CE of r)) into p.grad.
    """

    def __init__(self, model: torch.nn.Module, clip_norm: float | None, normalize: bool = False):
        self.model, self.clip_norm, self.normalize = model, clip_norm, normalize
        self.calls = 0

    def accumulate(self, input_ids, attention_mask, unit_ids, row_weights, loss_mask=None) -> dict:
        self.calls += 1
        params = [p for p in self.model.parameters() if p.requires_grad]
        loss_sum, n_rows, norms, clipped = 0.0, 0, [], 0
        for u in torch.unique(unit_ids[unit_ids >= 0]).tolist():
            acc = [torch.zeros_like(p) for p in params]
            for r in torch.nonzero(unit_ids == u).flatten().tolist():
                ids, mask = input_ids[r:r + 1], attention_mask[r:r + 1]
                labels = ids.masked_fill(mask == 0, -100)
                if loss_mask is not None:  # chat data: the answer tokens alone are targets
                    labels = labels.masked_fill(~loss_mask[r:r + 1].bool(), -100)
                loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
                g = torch.autograd.grad(loss * row_weights[r], params)
                for a, gi in zip(acc, g):
                    a.add_(gi)
                loss_sum += float(loss.detach())
                n_rows += 1
            norm = torch.sqrt(sum((a.double() ** 2).sum() for a in acc)).item()
            norms.append(norm)
            scale = 1.0
            if self.clip_norm is not None:
                scale = self.clip_norm / max(norm, 1e-12) if self.normalize else min(1.0, self.clip_norm / max(norm, 1e-12))
                clipped += int(norm > self.clip_norm)
            for p, a in zip(params, acc):
                p.grad.add_(a, alpha=scale)
        return MicroBatchStats(loss_sum=loss_sum, n_rows=n_rows, n_units=len(norms), unit_norms=torch.tensor(norms),
                               clipped_fraction=clipped / max(len(norms), 1))


class ConstantGradients:
    """Every unit contributes the same fixed vector (`value` in every coordinate); counts units."""

    def __init__(self, model, clip_norm, normalize=False, value: float = 1.0):
        self.model, self.value = model, value
        self.units_seen: list[int] = []

    def accumulate(self, input_ids, attention_mask, unit_ids, row_weights, loss_mask=None) -> dict:
        n = int(torch.unique(unit_ids[unit_ids >= 0]).numel())
        self.units_seen.append(n)
        for p in self.model.parameters():
            p.grad.add_(torch.full_like(p, self.value * n))
        return MicroBatchStats(loss_sum=0.0, n_rows=int((unit_ids >= 0).sum()), n_units=n)


def plan_for(pool, method: str, *, expected: float, steps: int, sigma: float = 1.0, clip: float | None = 1.0,
             delta: float = 1e-4, epsilon: float | None = None, epsilon_achieved: float | None = None) -> RunSpec:
    """A run spec for `pool` with sampling rate expected / N (epsilon: 8, or inf without noise)."""
    epsilon = (8.0 if sigma > 0 else math.inf) if epsilon is None else epsilon
    n = pool.n_examples if method == "els" else pool.n_users
    q = expected / n
    return RunSpec(
        dataset="test", method=method, epsilon=epsilon, delta=delta, group_size=pool.group_size,
        sampling_rate=q, steps=steps, expected_batch=expected, noise_multiplier=sigma,
        epsilon_achieved=epsilon_achieved, compute_budget=int(round(expected * steps)),
        accountant="pld", group_size_rule="explicit", clip_norm=clip, clipping="flat",
    )


def make_tokenizer(out_dir, vocab_size: int = 300) -> int:
    """Train the project's byte-level BPE on a few sentences into `out_dir`; return its vocabulary size."""
    import pyarrow.parquet as pq
    from pathlib import Path

    from userdp.data.tokenize import train_bpe

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    words = ["user", "level", "privacy", "model", "token", "noise", "clip", "sample", "step", "data"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=8)) for _ in range(200)]
    src = out_dir.parent / "tokenizer_texts.parquet"
    pq.write_table(pa.table({"text": texts}), src)
    info = train_bpe(src, vocab_size, out_dir, min_frequency=1)
    return int(info["vocab_size"])


def public_tokens_table(vocab: int, n: int = 400, seq: int = SEQ, seed: int = 0) -> pa.Table:
    """public_tokens.parquet-shaped rows drawn from a simple repetitive pattern (learnable)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        start = int(rng.integers(3, vocab - seq))
        rows.append([start + (k % 4) for k in range(seq)])  # a short cycle the model can learn
    return pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32())),
                     "n_tokens": pa.array([seq] * n, pa.int32())})


def train_pool(n_users: int, seed: int, group_size: int = 3):
    """The bounded training pool (G = group_size) of the train rows of `tokens_table(n_users, seed)`."""
    import pyarrow.compute as pc

    from userdp.training.pool import build_pool

    t = tokens_table(n_users, seed=seed)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    return build_pool(train, group_size, seed=0)


def run_settings(**kw):
    """TrainSettings for the engine tests: CPU, a progress line at every step, checkpoints every 2 steps."""
    from userdp.training.settings import TrainSettings

    base = dict(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, checkpoint_every=2, device="cpu",
                log_every_s=0.0)
    return TrainSettings(**(base | kw))


def constant_epsilon(event, delta):
    """A fast stand-in for the accountant where the epsilon's value is not under test."""
    return 1.0
