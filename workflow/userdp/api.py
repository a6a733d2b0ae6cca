"""The public Python API: plan a user-level DP run, fine-tune with it, account for it, load what it released.

The pipeline's own jobs use the same functions and objects: `plan` is the
planner of rule plan (workflow/scripts/plan_cell.py calls it), `fine_tune`
trains with the engine, the run inputs and the seeds of rule finetune
(`training.finetune_job.train_run`), and both write the same run folder
(model/ or a LoRA adapter, ledger.json, train_log.parquet; here also the
run's plan.json). Defaults are the pipeline's: every keyword a config file
could set is validated by the config schema and named like its key
(privacy.*, training.*). docs/api.md lists every public name.

    import pandas as pd, userdp
    rows = pd.read_parquet("my_users.parquet")            # columns: author, body
    run = userdp.fine_tune(
        model="path/to/local-hf-checkpoint", data=rows, user_column="author", text_column="body",
        method="uls", epsilon=4.0, compute=2000, steps=20, lora={"r": 8}, output_dir="out/uls-eps4")
    print(run.epsilon, run.delta, run.method, run.group_size, run.noise_multiplier)
    model = userdp.load_released("out/uls-eps4")          # the released model, adapter merged
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .arguments import check_group_size as _check_group_size
from .arguments import check_target as _check_target
from .errors import ConfigError, DataError, UserError
from .layout import ADAPTER_CONFIG, LEDGER, PLAN_FILE, RUN_MODEL, TOKENIZER, fmt_num
from .privacy.spec import RunSpec

log = logging.getLogger("userdp.api")



@dataclasses.dataclass(frozen=True)
class FineTuneResult:
    """What `fine_tune` released: the run folder, its spec (plan) and its ledger.

    `epsilon` is the released model's guarantee at `delta` (the ledger's, recomputed from the event of the steps
    that ran, composed with the DP contribution statistics if the spec spent part of the budget on them); the
    non-private reference (epsilon inf) has no guarantee.
    """

    output_dir: Path
    spec: RunSpec
    ledger: Mapping[str, Any]

    @property
    def epsilon(self) -> float:
        return float(self.ledger["epsilon"])

    @property
    def delta(self) -> float:
        return float(self.ledger["delta"])

    @property
    def method(self) -> str:
        return str(self.ledger["method"])

    @property
    def group_size(self) -> int:
        return int(self.ledger["group_size"])

    @property
    def noise_multiplier(self) -> float:
        return float(self.ledger["noise_multiplier"])

    @property
    def steps(self) -> int:
        return int(self.ledger["steps_completed"])

    @property
    def model_dir(self) -> Path:
        return self.output_dir / RUN_MODEL


def _check_counts(counts: Any) -> np.ndarray:
    arr = np.asarray(counts)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer) or (arr < 1).any():
        raise DataError(f"counts must be a non-empty 1-D sequence of whole numbers >= 1, one per train user (the "
                        f"examples each contributes); got shape {arr.shape}, dtype {arr.dtype}"
                        + (f", smallest {arr.min()}" if arr.size and np.issubdtype(arr.dtype, np.number) else "")
                        + ".")
    return arr.astype(np.int64)


def plan(method: str, epsilon: float, *, counts: Sequence[int] | np.ndarray, compute: int, steps: int,
         delta: float | None = None, group_size: int | None = None, privacy: Mapping[str, Any] | None = None,
         learning_rates: int = 1, dataset: str = "data", contribution_stats: Any = None,
         reference_epsilon: float | None = None, selection: Any = None) -> RunSpec:
    """A calibrated run specification: G by the method's rule, the sampling rate that spends `compute` examples
    in `steps` steps, and the noise multiplier that reaches `epsilon` at `delta`.

    counts: examples per train user (their contributions), or pass `contribution_stats` (a
    privacy.contribution_stats.NoisyHistogram release, with privacy={"contribution_stats": {"private": True}}) so
    the G rules and sizes read the DP histogram instead. delta: default 1 / N^1.1 (privacy.delta_exponent).
    group_size: an explicit G (default: privacy.group_size's rule, median for ELS and snr for ULS).
    privacy: further privacy.* keys (clip_norm, clipping, selection, ...), validated like a config file's.
    learning_rates: how many learning-rate runs the released model is chosen among (privacy.selection
    accounts for them: each run's noise is calibrated so the selection meets epsilon); `selection` (a
    privacy.selection.Selection or its record, as rule plan passes it) replaces that. reference_epsilon: for
    the non-private reference (epsilon inf), the epsilon whose G it reuses.
    """
    from .config import run_config
    from .privacy.planner import plan_cell
    from .privacy.selection import Selection

    eps = _check_target(method, epsilon, compute, steps)
    group_size = _check_group_size(group_size)
    counts = _check_counts(counts)
    section = dict(privacy or {})
    if delta is not None:
        section["delta"] = delta
    cfg = run_config(privacy=section, source="userdp.plan")["privacy"]
    if selection is None:
        selection = Selection.from_config(cfg, int(learning_rates))
    elif not isinstance(selection, Selection):
        selection = Selection.from_record(selection)
    return plan_cell(dataset=dataset, method=method, epsilon=eps, compute_budget=int(compute), steps=int(steps),
                     counts=counts, privacy=cfg, group_size=group_size,
                     reference_epsilon=reference_epsilon, stats=contribution_stats, selection=selection)


def epsilon(source: RunSpec | Mapping[str, Any] | str | os.PathLike, delta: float | None = None, *,
            per_run: bool = False) -> float:
    """Epsilon at `delta` (default: the one recorded) re-accounted from the events themselves.

    source: a RunSpec: the released model's guarantee under the spec's learning-rate selection (its
    candidate runs of T steps each, composed with its DP contribution statistics: what `spec.epsilon_achieved`
    predicts); with `per_run`, one run's own epsilon (what a complete run's ledger records). Or a ledger (dict)
    or a run folder / ledger.json path: that run's epsilon from its `dp_event` (the steps that ran). A run
    without noise has no guarantee: inf.
    """
    from .privacy.contribution_stats import events_from_record
    from .training.ledger import guarantee_epsilon, run_event

    if isinstance(source, RunSpec):
        at = source.delta if delta is None else delta
        if per_run:
            return guarantee_epsilon([source.event], at, source.contribution_stats)
        return source.selection_policy.released_epsilon(source.mechanism, source.noise_multiplier, at,
                                                        events_from_record(source.contribution_stats))
    ledger = read_ledger(source) if isinstance(source, (str, os.PathLike)) else source
    return guarantee_epsilon([run_event(ledger)], float(ledger["delta"]) if delta is None else delta,
                             ledger.get("contribution_stats"))


def read_ledger(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The ledger of a run folder (or a ledger.json path): what ran and its guarantee (docs/artifacts.md)."""
    from .io import read_json

    path = Path(run_dir)
    return read_json(path if path.suffix == ".json" else path / LEDGER)


def load_released(run_dir: str | os.PathLike, *, with_ledger: bool = False, with_card: bool = False,
                  device: str = "cpu") -> Any:
    """The released model of a run folder (`fine_tune`'s output_dir, `PrivateTraining.save`'s folder,
    `UserDPTrainer.save_model`'s or a pipeline run folder), a LoRA adapter merged into its base model; with
    `with_ledger`, (model, ledger); with `with_card`, also the model card's facts (a dict rendered from the
    ledger: training.model_card.card_facts), last."""
    from .training.model_card import card_facts
    from .training.models import load_model

    folder = _released_folder(run_dir)
    model = load_model(folder, device, local=True, merge=True).eval()
    if not (with_ledger or with_card):
        return model
    ledger = read_ledger(folder.parent if folder.name == RUN_MODEL else folder)
    return (model,) + ((ledger,) if with_ledger else ()) + ((card_facts(ledger),) if with_card else ())


def _released_folder(run_dir: str | os.PathLike) -> Path:
    """The folder of the released model: `run_dir` itself when it holds a model or an adapter, else its model/
    (a DataError when there is none)."""
    path = Path(run_dir)
    folder = path if (path / "config.json").exists() or (path / ADAPTER_CONFIG).exists() else path / RUN_MODEL
    if not folder.is_dir():
        raise DataError(f"{run_dir} holds no released model (no {RUN_MODEL}/ folder with config.json or "
                        "adapter_config.json); give the output_dir of userdp.fine_tune or a run folder.")
    return folder


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """What `evaluate` measured: the pipeline's metrics (`loss`, micro over tokens; `loss_user_macro`;
    `perplexity`; `accuracy`; `n_tokens`, `n_examples`, `n_users`) and `users`, one row per user with the columns
    of eval_users.parquet (user_id, nll, n_tokens, n_examples, loss: the user's own token-average)."""

    metrics: dict[str, Any]
    users: Any

    @property
    def loss(self) -> float:
        return float(self.metrics["loss"])

    @property
    def loss_user_macro(self) -> float:
        return float(self.metrics["loss_user_macro"])

    @property
    def perplexity(self) -> float:
        return float(self.metrics["perplexity"])

    @property
    def accuracy(self) -> float:
        return float(self.metrics["accuracy"])


def evaluate(model: str | os.PathLike, *, data: Any, user_column: str, text_column: str | None = None,
             tokenizer: str | os.PathLike | None = None, sequence_length: int | None = None,
             batch_size: int | None = None, device: str = "cpu", messages_column: str | None = None,
             prompt_column: str | None = None, completion_column: str | None = None) -> EvaluationResult:
    """Next-token metrics of a model on held-out users' (user, text) rows, overall and per user.

    model: a run folder (`fine_tune`'s output_dir or a pipeline run folder: its released model, a LoRA adapter
    merged) or a model folder saved with save_pretrained. data, user_column, text_column: as `fine_tune`'s; give
    users the model was not trained on. tokenizer: default the model folder's, else a LoRA adapter's base model
    folder's; a fully fine-tuned run folder holds none, so pass the folder of the model it was tuned from.
    sequence_length: default the pipeline's 64 (texts are cut as `fine_tune` cuts them). batch_size: default
    evaluation.batch_size. The metrics are the pipeline's (userdp.evaluation.metrics), on every
    row given. messages_column / prompt_column + completion_column: chat or instruction rows instead of text
    (as `fine_tune`'s); the metrics are then over the answer tokens alone.
    """
    from .config import run_config
    from .data.chat import Framing, loss_masks
    from .evaluation.metrics import per_user_scores, sequence_scores, summarise
    from .training.models import check_model_fits, resolve_device

    cfg = run_config(sequence_length=sequence_length, source="userdp.evaluate")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                                   or batch_size < 1):
        raise ConfigError(f"batch_size is {batch_size!r}; give a positive integer (sequences scored at once).")
    size = int(cfg["evaluation"]["batch_size"] if batch_size is None else batch_size)
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device is {device!r}; give 'cpu', 'cuda' or 'auto'.")
    framing = Framing.of(text_column=text_column, messages_column=messages_column, prompt_column=prompt_column,
                         completion_column=completion_column)
    users, examples = _rows(data, user_column, framing)
    tok = _tokenizer(tokenizer if tokenizer is not None else _tokenizer_of(model))
    dev = resolve_device(device)
    released = load_released(model, device=str(dev))
    length = int(cfg["tokenizer"]["sequence_length"])
    check_model_fits(released, str(model), tok, length)
    table = _tokens_table(tok, users, examples, length, framing.kind)
    sequences = [np.asarray(x, dtype=np.int64) for x in table.column("input_ids").to_pylist()]
    nll, correct, n_targets = sequence_scores(released, sequences, size, dev, loss_masks(table))
    return EvaluationResult(summarise(nll, correct, n_targets, users), per_user_scores(nll, n_targets, users))


def _tokenizer_of(model: str | os.PathLike) -> str:
    """The tokenizer folder `evaluate` uses by default: the model folder's, else a LoRA adapter's base model's."""
    from .io import read_json

    folder = _released_folder(Path(model).expanduser().resolve())
    adapter = folder / ADAPTER_CONFIG
    base = read_json(adapter).get("base_model_name_or_path") if adapter.exists() else None
    for folder in [folder] + ([Path(base)] if base else []):
        if any((folder / name).exists() for name in (Path(TOKENIZER).name, "tokenizer_config.json")):
            return str(folder)
    raise ConfigError(f"{model} holds no tokenizer (no tokenizer.json in the model folder or a LoRA adapter's base "
                      "model folder); pass tokenizer= the folder (or hub id) of the tokenizer the model was trained "
                      "with, for example the model folder you gave fine_tune.")


def audit_mechanism(config: str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, Any], *,
                    method: str | None = None, epsilon: float | None = None, dataset: str = "",
                    threads: int | None = None) -> list[dict[str, Any]]:
    """The white-box audit of the user-level mechanism (docs/audits.md, "White-box audit of the mechanism"):
    Dirac canary users trained through the real engine for each cell of the config's audit.methods x
    audit.epsilons (or the one `method` / `epsilon` name), every privatised update scored; one dict per cell
    with the columns of mechanism.csv (claimed and empirical epsilon, ceilings, the exact noise and divisor
    checks). `config`: a config file, several (merged over config/config.yaml as `--configfile` does) or a
    config mapping. A cell the config does not audit is a ConfigError before anything trains. The pipeline's
    target `audit_mechanism` and `userdp audit-mechanism` run the same audit.
    """
    from .config import load_config_files, validate_config
    from .evaluation import mechanism_audit

    if isinstance(config, Mapping):
        cfg = validate_config(dict(config), source="userdp.audit_mechanism config")
    else:
        cfg = load_config_files(config)
    params = mechanism_audit.mechanism_params(cfg)
    mechanism_audit.select_cells(params, method, epsilon)  # a cell not audited fails before training
    threads = int(cfg["training"]["threads"]) if threads is None else int(threads)
    return mechanism_audit.run_audit(params, dataset, method=method, epsilon=epsilon, threads=threads)


def fine_tune(*, model: str | os.PathLike, data: Any, user_column: str, method: str,
              epsilon: float, compute: int, steps: int, output_dir: str | os.PathLike,
              text_column: str | None = None, messages_column: str | None = None,
              prompt_column: str | None = None, completion_column: str | None = None,
              lora: Mapping[str, Any] | Any = None, tokenizer: str | os.PathLike | None = None,
              delta: float | None = None, learning_rate: float | None = None, group_size: int | None = None,
              sequence_length: int | None = None, seed: int = 0, secret_seeds: bool | None = None,
              privacy: Mapping[str, Any] | None = None, training: Mapping[str, Any] | None = None
              ) -> FineTuneResult:
    """Fine-tune `model` on `data` with user-level DP (DP-SGD with example- or user-level sampling).

    model: a Hugging Face causal LM folder saved with save_pretrained (or a hub id). data: a pandas DataFrame (or
    anything with columns) with one row per example, `user_column` naming its user and `text_column` its text;
    every user is a train user. Chat data: `messages_column` (each row a list of {"role", "content"} dicts,
    framed with the tokenizer's chat template, the loss on the assistant's messages only) instead of
    `text_column`; instruction data: `prompt_column` and `completion_column` (the loss on the completion only).
    method: "els" or "uls". epsilon: the released model's target (math.inf: the
    non-private reference). compute: examples processed in expectation over the run (K). steps: noisy steps T.
    output_dir: the run folder (model/ or the LoRA adapter, ledger.json, train_log.parquet, plan.json); a run of
    the same inputs finished there before is restored, not retrained, and an interrupted one resumes.
    lora: None = full fine-tuning, a peft LoraConfig (used as it is), or model.lora keys (r, alpha, dropout,
    target_modules). tokenizer: default
    the model folder's. delta: default 1 / N^1.1. learning_rate: default training.learning_rates[0].
    secret_seeds: default True (user data: the sampling and noise randomness is fresh OS entropy, never
    written); False derives it from `seed` (reproducible, but the guarantee does not hold against whoever has
    the seed). privacy / training: further privacy.* / training.* keys, validated like a config file's.

    Bad input raises the project's errors (ConfigError, DataError, PrivacyError) before anything is written in
    output_dir.
    """
    from .config import run_config
    from .data.chat import Framing

    eps = _check_target(method, epsilon, compute, steps)
    group_size = _check_group_size(group_size)
    framing = Framing.of(text_column=text_column, messages_column=messages_column, prompt_column=prompt_column,
                         completion_column=completion_column)
    out = _output_dir(output_dir)
    model = _local_or_hub(model)
    train = dict(training or {})
    if learning_rate is not None:
        train["learning_rates"] = [learning_rate]
    if len(train.get("learning_rates") or [None]) != 1:
        raise ConfigError(f"training.learning_rates is {train['learning_rates']}: fine_tune trains one run; pass "
                          "learning_rate= (choosing among rates on held-out users is the pipeline's "
                          "privacy.selection).")
    privacy_section = dict(privacy or {})
    if delta is not None:
        privacy_section["delta"] = delta
    peft_config = _peft_lora(lora)
    cfg = run_config(model=model, tokenizer=None if tokenizer is None else _local_or_hub(tokenizer),
                     lora=None if lora is None or peft_config is not None else dict(lora), seed=seed,
                     privacy=privacy_section, training=train, sequence_length=sequence_length)
    lr = float(cfg["training"]["learning_rates"][0])
    secret = _secret(secret_seeds, cfg["privacy"]["secret_seeds"])
    tok, spec, pool = _prepare(data, user_column, framing, cfg["tokenizer"]["name"], cfg, method, eps, compute,
                               steps, group_size)
    outcome = _train(cfg, spec, pool, tok, model, out, lr, method, eps, int(compute), secret, peft_config)
    spec.write(out / PLAN_FILE)
    return FineTuneResult(out, spec, outcome.ledger)


def _peft_lora(lora: Any) -> Any:
    """`lora` when it is a peft LoraConfig (used as it is), else None (the model.lora keys, or no LoRA)."""
    if lora is None or isinstance(lora, Mapping):
        return None
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    raise ConfigError(f"lora is a {type(lora).__name__}; give a peft.LoraConfig, the model.lora keys as a dict "
                      "(r, alpha, dropout, target_modules), or None for full fine-tuning.")


def _prepare(data: Any, user_column: str, framing: Any, tokenizer: Any, cfg: dict, method: str, eps: float,
             compute: int, steps: int | None, group_size: int | None, *, model: Any = None,
             spec: RunSpec | Any = None) -> tuple[Any, RunSpec, Any]:
    """(tokenizer, spec, pool) of the rows (fine_tune's, make_private's, UserDPTrainer's): checked and framed
    (`_rows`, `_tokens_table`), the mechanism planned on the users' counts for `steps` steps (or `spec`, a
    RunSpec or its record), every user bounded to G. `model`: a model object, checked against the tokenizer and
    the sequence length."""
    from .config import API_DATASET
    from .training.finetune_job import bounding_seed
    from .training.models import check_model_fits
    from .training.pool import build_pool

    users, examples = _rows(data, user_column, framing)
    tok = _tokenizer(tokenizer)
    length = int(cfg["tokenizer"]["sequence_length"])
    if model is not None:
        check_model_fits(model, type(model).__name__, tok, length)
    table = _tokens_table(tok, users, examples, length, framing.kind)
    if spec is None:
        counts = np.unique(np.asarray(users), return_counts=True)[1]
        spec = plan(method, eps, counts=counts, compute=int(compute), steps=int(steps), group_size=group_size,
                    privacy=cfg["privacy"], dataset=API_DATASET)
    else:
        spec = RunSpec.from_record(spec)
    return tok, spec, build_pool(table, spec.group_size, bounding_seed(cfg["seed"], API_DATASET, 0, spec.group_size))


def _train(cfg: dict, spec: RunSpec, pool: Any, tok: Any, model: str, out: Path, lr: float, method: str,
           eps: float, compute: int, secret: bool, peft_config: Any = None) -> Any:
    """Train the bounded pool through the pipeline's run (training.finetune_job.train_run)."""
    from .config import API_DATASET
    from .training import finetune_job

    run_seed = 0
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        outcome = finetune_job.train_run(finetune_job.RunInputs(
            config=cfg, spec=spec, pool=pool, tokenizer=tok, model=model, run_dir=str(out), learning_rate=lr,
            dataset=API_DATASET, method=method, eps=fmt_num(eps), budget=compute, seed=run_seed, secret=secret,
            lora=peft_config))
    except UserError:
        if created:  # bad input found while setting up (model, LoRA, G vs batch size): leave nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    if not outcome.complete:  # pragma: no cover - train without max_steps runs to T or raises
        raise RuntimeError(f"run stopped at step {outcome.steps_completed}/{spec.steps}")
    return outcome


def _secret(argument: bool | None, configured: bool | None) -> bool:
    """secret_seeds=, else privacy.secret_seeds, else True (user data: fresh OS entropy, never written)."""
    if argument is not None and configured is not None and bool(argument) != bool(configured):
        raise ConfigError(f"secret_seeds={argument} but privacy.secret_seeds is {configured}; give one of them.")
    return bool(argument if argument is not None else (True if configured is None else configured))


def _local_or_hub(name: str | os.PathLike) -> str:
    """A local folder as an absolute path (a LoRA adapter records its base model's path: it must load from
    anywhere), a hub id as it is."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else str(name)


def _output_dir(output_dir: str | os.PathLike) -> Path:
    out = Path(output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {output_dir} is a file; give a folder (it is created if missing).")
    return out


def _rows(data: Any, user_column: str, framing: Any) -> tuple[list[str], list]:
    """(user ids, examples) of the rows, checked: the columns exist, every row has a user id and an example.

    framing: a `data.chat.Framing`. The examples are texts, checked conversations (lists of {"role", "content"}
    dicts) or (prompt, completion) pairs.
    """
    from .data.chat import check_example

    wanted = (user_column, *framing.columns)
    names = getattr(data, "column_names", None)  # a pyarrow Table's `columns` are its arrays
    columns = [str(c) for c in (names if names is not None else getattr(data, "columns", []))]
    named = " and ".join(repr(c) for c in wanted)
    if not columns:
        raise DataError(f"data is a {type(data).__name__}; give a pandas DataFrame (or pyarrow Table) with one row "
                        f"per example and the columns {named}.")
    missing = [c for c in wanted if c not in columns]
    if missing:
        given = ", ".join(f"{k} {v!r}" for k, v in zip(("user_column", *framing.column_keys), wanted))
        raise DataError(f"data has no column(s) {missing} ({given}); its columns are {columns}. Rename them or "
                        "pass the right names.")
    twice = sorted({c for c in wanted if columns.count(c) > 1})
    if twice:
        raise DataError(f"data has the column(s) {twice} more than once; rename or drop the copies.")
    users = _column(data, user_column)
    values = [_column(data, c) for c in framing.columns]
    if not users:
        raise DataError("data has no rows; it needs at least one row per train user.")
    from pandas import isna

    kinds = set()
    examples = []
    where_column = "column " + " / ".join(repr(c) for c in framing.columns)
    for i, u in enumerate(users):
        if u is None or (not isinstance(u, (str, list, tuple)) and isna(u)) or not str(u).strip():
            raise DataError(f"data row {i} has no user id in column {user_column!r}; every row needs one: fill "
                            "it in or drop the row.")
        if isinstance(u, bool) or not isinstance(u, (str, numbers.Integral)):
            raise DataError(f"data row {i}: user id {u!r} in column {user_column!r} is a {type(u).__name__}; "
                            "user ids must be strings or integers.")
        kinds.add(str if isinstance(u, str) else int)
        examples.append(check_example(framing.kind, [v[i] for v in values], f"data row {i}: {where_column}"))
    if len(kinds) > 1:
        raise DataError(f"column {user_column!r} mixes integer and string user ids (7 and '7' would become one "
                        "user); store them all as strings or all as integers.")
    return [str(u) for u in users], examples


def _column(data: Any, name: str) -> list:
    col = data[name]
    return col.to_pylist() if hasattr(col, "to_pylist") else list(col)


def _tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as the pipeline's data stage prepares it (bos and pad fall back to eos), from its folder or
    hub id, or from a tokenizer object (make_private's, UserDPTrainer's)."""
    from .data.tokenize import load_named, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="userdp-tokenizer-") as staging:
        if isinstance(tokenizer, (str, Path)):
            name = _local_or_hub(tokenizer)
        elif hasattr(tokenizer, "save_pretrained"):
            name = str(Path(staging) / "given")
            tokenizer.save_pretrained(name)
        else:
            raise ConfigError(f"tokenizer is a {type(tokenizer).__name__}; give the model's tokenizer "
                              "(AutoTokenizer.from_pretrained(...)) or its folder.")
        load_named(name, Path(staging) / "tokenizer")
        return load_tokenizer(Path(staging) / "tokenizer")


def _tokens_table(tok: Any, users: list[str], examples: list, sequence_length: int, kind: str = "text") -> Any:
    """The rows as a tokens table (the data stage's columns): bos + text + eos cut to the sequence length, or
    chat / instruction examples framed by `data.chat.frame_examples` with their `loss_mask` column."""
    import pyarrow as pa

    from .data.chat import LOSS_MASK, frame_examples, warn_cut_answers
    from .data.token_ids import special_token_ids
    from .data.tokenize import encode, frame, list_array

    mask = None
    if kind == "text":
        flat, lengths = encode(tok, examples)
        bos, eos = special_token_ids(tok)
        ids, out_len, _ = frame(flat, lengths, bos, eos, sequence_length, "truncate")
    else:
        ids, out_len, mask, empty = frame_examples(tok, kind, examples, sequence_length,
                                                   where=[f"data row {i}" for i in range(len(examples))])
        warn_cut_answers(empty, len(examples), sequence_length)
    columns = {
        "user_id": pa.array(users, pa.string()),
        "example_id": pa.array(np.arange(len(users), dtype=np.int64)),
        "split": pa.array(["train"] * len(users), pa.string()),
        "input_ids": list_array(ids, out_len),
        "n_tokens": pa.array(out_len.astype(np.int32)),
    }
    if mask is not None:
        columns[LOSS_MASK] = list_array(mask, out_len, pa.bool_())
    return pa.table(columns)
