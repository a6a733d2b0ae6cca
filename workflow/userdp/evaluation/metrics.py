"""Next-token metrics of a causal language model on held-out users.

The metric is the study's: next-token cross-entropy on users who were never
trained on. Every token after the first (the bos token each row starts with)
is a prediction target. We report

- ``loss``: cross-entropy micro-averaged over all target tokens (primary);
- ``loss_user_macro``: each user's own token-average, averaged over users, so
  that users with many examples do not dominate;
- ``perplexity`` = exp(``loss``);
- ``accuracy``: share of target tokens whose argmax prediction is right.

Only the validation and test splits can be evaluated (`load_eval_set`
refuses the train split), and the chosen users are checked to have no rows
in any other split before anything is evaluated.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch
import torch.nn.functional as F

from ..data.chat import LOSS_MASK, loss_masks
from ..errors import DataError
from ..io import read_schema, write_json, write_parquet
from ..layout import EVAL, EVAL_USERS, RUN_MODEL
from ..seeding import derive_seed
from ..training.models import load_model, resolve_device
from .targets import EVAL_SPLITS, USER_SCORE_COLUMNS

log = logging.getLogger(__name__)

TOKENS_COLUMNS = ("user_id", "split", "input_ids")


@dataclass(frozen=True)
class EvalSet:
    """The examples of the chosen users of one held-out split.

    `user_ids[i]` owns `sequences[i]`; `users` is the sorted list of chosen users. `loss_masks[i]`: which of
    sequence i's tokens are targets (chat and instruction data), None: all of them (plain text).
    """

    split: str
    users: list[str]
    user_ids: list[str]
    sequences: list[np.ndarray]
    loss_masks: list[np.ndarray] | None = None


def choose_users(users: Sequence[str], max_users: int | None, seed: int) -> list[str]:
    """All distinct `users`, or a seeded uniform choice of `max_users` of them (sorted)."""
    unique = sorted(set(users))
    if max_users is None or len(unique) <= max_users:
        return unique
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(unique), size=int(max_users), replace=False)
    return sorted(unique[i] for i in picked)


def check_held_out(tokens_path: str | os.PathLike, users: Sequence[str], split: str) -> None:
    """Raise DataError if any of `users` (chosen from `split`) has rows in another split.

    Evaluation users must never be training users (docs/method.md section 1); this
    guards against a tokens table that breaks the user-level split. Only the
    chosen users' rows are scanned (predicate push-down), so it stays cheap
    on large corpora.
    """
    table = ds.dataset(str(tokens_path), format="parquet").to_table(
        columns=["user_id", "split"],
        filter=ds.field("user_id").isin(list(users)) & (ds.field("split") != split),
    )
    if table.num_rows:
        bad = sorted(set(table.column("user_id").to_pylist()))
        others = sorted(set(table.column("split").to_pylist()))
        raise DataError(
            f"{tokens_path}: {len(bad)} {split} user(s) also have rows in split(s) {others} (e.g. {bad[:3]}); "
            "train, validation and test users must be disjoint. Rebuild the data stage "
            "(delete results/data/<dataset>/ and rerun)."
        )


def load_eval_set(
    tokens_path: str | os.PathLike, split: str, max_users: int | None, seed: int
) -> EvalSet:
    """Read the token rows of a seeded choice of at most `max_users` users of `split`.

    `split` must be "validation" or "test": training users are never evaluated.
    """
    if split not in EVAL_SPLITS:
        raise ValueError(f"evaluation reads only the {EVAL_SPLITS} splits, not {split!r}")
    path = Path(tokens_path)
    if not path.exists():
        raise DataError(f"tokens table {path} does not exist; run the data stage first (results/data/<dataset>/tokens.parquet).")
    names = set(read_schema(path).names)
    missing = [c for c in TOKENS_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; expected at least {list(TOKENS_COLUMNS)}.")
    data = ds.dataset(str(path), format="parquet")
    in_split = ds.field("split") == split
    # Choose users from the user column alone; read token rows only for them.
    candidates = data.to_table(columns=["user_id"], filter=in_split).column("user_id")
    if len(candidates) == 0:
        name = Path(path).parent.name
        raise DataError(
            f"{path}: no rows with split == {split!r}; dataset {name!r} needs {split} users. The user split is a "
            f"fraction of users (datasets.{name}.split.{split}), so a dataset with few users can get none: raise "
            f"the fraction or use more users."
        )
    users = choose_users(pc.unique(candidates).to_pylist(), max_users, seed)
    check_held_out(path, users, split)
    columns = list(TOKENS_COLUMNS) + ([LOSS_MASK] if LOSS_MASK in names else [])
    table = data.to_table(columns=columns, filter=in_split & ds.field("user_id").isin(users))
    # A defensive second check on the rows actually used.
    splits = set(table.column("split").to_pylist())
    assert splits == {split}, f"rows of splits {splits} leaked into the {split} evaluation set"
    sequences = [np.asarray(x, dtype=np.int64) for x in table.column("input_ids").to_pylist()]
    return EvalSet(split=split, users=users, user_ids=table.column("user_id").to_pylist(), sequences=sequences,
                   loss_masks=loss_masks(table))


@torch.no_grad()
def sequence_scores(
    model: torch.nn.Module,
    sequences: Sequence[np.ndarray],
    batch_size: int,
    device: torch.device | str = "cpu",
    loss_masks: Sequence[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sequence: summed next-token NLL, number of correct argmax predictions, targets.

    loss_masks: per sequence, which tokens are targets (chat and instruction data: the answers, as in
    training); None: every token after the first.

    Sequences are sorted by length and right-padded per batch, so little
    compute goes to padding; padded positions are masked out of every sum
    (with right padding the real tokens never attend to pads under the causal
    mask, and their positions are unchanged).
    """
    device = torch.device(device)
    n = len(sequences)
    nll = np.zeros(n, dtype=np.float64)
    correct = np.zeros(n, dtype=np.int64)
    n_targets = np.zeros(n, dtype=np.int64)
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        width = int(lengths[idx].max())
        if width < 2:  # only bos: nothing to predict
            continue
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        is_target = torch.zeros((len(idx), width), dtype=torch.bool)
        for row, i in enumerate(idx):
            ids[row, : lengths[i]] = torch.from_numpy(sequences[i])
            mask[row, : lengths[i]] = 1
            is_target[row, : lengths[i]] = True if loss_masks is None else torch.from_numpy(loss_masks[i])
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = ids[:, 1:]
        tmask = is_target[:, 1:].to(device)
        token_nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        token_nll = token_nll.view(targets.shape).masked_fill(~tmask, 0.0)
        hits = (logits.argmax(dim=-1) == targets) & tmask
        nll[idx] = token_nll.double().sum(dim=1).cpu().numpy()
        correct[idx] = hits.sum(dim=1).cpu().numpy()
        n_targets[idx] = tmask.sum(dim=1).cpu().numpy()
    return nll, correct, n_targets


def per_user_scores(nll: np.ndarray, n_targets: np.ndarray, user_ids: Sequence[str]) -> pd.DataFrame:
    """Per user (sorted): summed next-token NLL, target tokens, examples and the user's own token-average loss.

    Users whose rows hold no target token (only bos) keep n_tokens 0 and a NaN loss.
    """
    df = pd.DataFrame({"user_id": list(user_ids), "nll": np.asarray(nll, dtype=np.float64),
                       "n_tokens": np.asarray(n_targets, dtype=np.int64), "n_examples": 1})
    per_user = df.groupby("user_id", sort=True)[["nll", "n_tokens", "n_examples"]].sum().reset_index()
    with np.errstate(invalid="ignore", divide="ignore"):
        per_user["loss"] = np.where(per_user["n_tokens"] > 0, per_user["nll"] / per_user["n_tokens"], np.nan)
    return per_user[list(USER_SCORE_COLUMNS)]


def summarise(nll: np.ndarray, correct: np.ndarray, n_targets: np.ndarray, user_ids: Sequence[str]) -> dict:
    """Micro (token) and macro (user) averages of per-sequence sums."""
    total = int(n_targets.sum())
    if total == 0:
        raise DataError("the evaluation set has no target tokens (every row is only the bos token, or, for chat and "
                        "instruction data, every answer was cut by the sequence length: raise it).")
    per_user = per_user_scores(nll, n_targets, user_ids)
    per_user = per_user[per_user["n_tokens"] > 0]
    loss = float(nll.sum() / total)
    return {
        "loss": loss,
        "loss_user_macro": float(per_user["loss"].mean()),
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "accuracy": float(correct.sum() / total),
        "n_tokens": total,
        "n_examples": int(len(nll)),
        "n_users": int(len(per_user)),
    }


def evaluate_set(model: torch.nn.Module, eval_set: EvalSet, batch_size: int, device: torch.device | str,
                 users_out: str | os.PathLike | None = None) -> dict:
    """The metrics of `model` on one evaluation set; with `users_out`, its per-user scores written there too."""
    nll, correct, n_targets = sequence_scores(model, eval_set.sequences, batch_size, device, eval_set.loss_masks)
    metrics = summarise(nll, correct, n_targets, eval_set.user_ids)
    if users_out is not None:
        write_parquet(users_out, per_user_scores(nll, n_targets, eval_set.user_ids))
    return metrics


def evaluate_models(
    model_paths: Sequence[str | os.PathLike],
    tokens_path: str | os.PathLike,
    *,
    dataset: str,
    root_seed: int,
    max_users: int | None,
    batch_size: int,
    device: str = "auto",
    local_model: bool = True,
    splits: Sequence[str] = EVAL_SPLITS,
    users_out: Sequence[str | os.PathLike | None] | None = None,
) -> list[dict]:
    """Validation and test metrics of each model in turn (a fine-tuning job's runs: its cell's learning rates), as
    flat `{split}_{metric}` fields.

    The users are a seeded choice that depends on the config seed, the dataset and the split only, so every run
    and the pretrained model are evaluated on the same users (paired comparisons); they and their rows are read
    once and shared, so each model sees exactly the sets it would alone. `splits` are the held-out splits scored
    (userdp.evaluation.targets.evaluated_splits), each on the same users whichever others are scored.
    `users_out`, if given, holds one path (or None) per model: that model's per-user scores on the TEST users
    (`per_user_scores`) are written there (eval_users.parquet; test users only, never validation users).
    """
    splits = list(splits)
    if users_out is not None:
        users_out = list(users_out)
        if len(users_out) != len(model_paths):
            raise ValueError(f"users_out needs one path per model ({len(model_paths)}), not {len(users_out)}")
        if any(u is not None for u in users_out) and "test" not in splits:
            raise ValueError("per-user scores are of test users: users_out needs the test split scored")
    if not splits or any(s not in EVAL_SPLITS for s in splits) or len(set(splits)) < len(splits):
        raise ValueError(f"splits must be distinct names out of {EVAL_SPLITS}, not {splits}")
    dev = resolve_device(device)
    eval_sets: dict[str, EvalSet] = {}
    for split in splits:
        seed = derive_seed(root_seed, "evaluation", dataset, split)
        eval_sets[split] = load_eval_set(tokens_path, split, max_users, seed)
    results = []
    for i, model_path in enumerate(model_paths):
        if len(model_paths) > 1:
            log.info("model %s", model_path)
        model = load_model(model_path, dev, local=local_model).eval()
        out: dict = {}
        for split, eval_set in eval_sets.items():
            log.info("%s: %d users, %d examples", split, len(eval_set.users), len(eval_set.sequences))
            out_users = users_out[i] if users_out is not None and split == "test" else None
            metrics = evaluate_set(model, eval_set, batch_size, dev, out_users)
            log.info("%s: loss %.4f, user-macro loss %.4f, accuracy %.4f", split, metrics["loss"],
                     metrics["loss_user_macro"], metrics["accuracy"])
            out.update({f"{split}_{k}": v for k, v in metrics.items()})
        out["evaluation"] = {"max_users": max_users, "batch_size": batch_size, "seed": root_seed, "device": str(dev),
                             "splits": splits}
        results.append(out)
        del model
    return results


def evaluate_runs(runs: Sequence[tuple[float, str | os.PathLike]], tokens_path: str | os.PathLike, **options) -> None:
    """Evaluate the fine-tuned model of each (learning rate, run folder) of a fine-tuning job and write the
    folder's eval.json (the metrics, the model folder and the rate) and eval_users.parquet (each test user's
    scores). `options`: `evaluate_models`' keywords (dataset, root_seed, max_users, batch_size, device, splits)."""
    folders = [Path(run_dir) for _, run_dir in runs]
    models = [str(d / RUN_MODEL) for d in folders]
    results = evaluate_models(models, tokens_path, local_model=True, users_out=[str(d / EVAL_USERS) for d in folders],
                              **options)
    for (rate, _), folder, model, result in zip(runs, folders, models, results, strict=True):
        write_json(str(folder / EVAL), {**result, "model": model, "learning_rate": float(rate)})
