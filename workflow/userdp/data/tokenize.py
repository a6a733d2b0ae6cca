"""The tokenizer stage (BPE trained on PUBLIC text, or a named one) and token ids.

Tokenizer: when `tokenizer.name` is set, the named Hugging Face tokenizer (a
hub name or a local folder) is loaded and saved to results/tokenizer/.
Otherwise a byte-level BPE is trained with the `tokenizers` library on the
public corpus only (`tokenizer.public_dataset`'s public.parquet): a
tokenizer trained on private text would leak rare private strings through
its merges and vocabulary. Either way results/tokenizer/ then loads with
`AutoTokenizer.from_pretrained("results/tokenizer")` or
`PreTrainedTokenizerFast(tokenizer_file="results/tokenizer/tokenizer.json")`,
with bos, eos and pad tokens set.

Tokens: each example becomes [bos] + tokens + [eos]. With `long_examples:
truncate` it is cut to `sequence_length` tokens (a cut example loses its
eos); with `chunk` it is split into consecutive windows of `sequence_length`
tokens, each a new example of the SAME user with a new unique `example_id`
(`source_example_id` points back to examples.parquet; windows of a single
token, which hold no next-token target, are dropped). Framing is vectorised
with numpy; reading and writing stream in batches of `batch_rows`.

Speed (benchmarks/bench_tokenize.py, 200k synthetic examples): the Rust
`encode_batch_fast` is about three quarters of the work; the rest (Encoding
objects -> ids, reading, framing, writing) is serial Python that Rayon cannot
spread. With `threads` > 1 whole batches go to worker processes, so encoding
and the per-example Python work both scale with the CPUs, and the main
process only reads, frames and writes in input order (~10% of the CPU time):
the output is byte-identical for any number of threads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from ..errors import ConfigError, DataError
from ..io import ParquetBatchWriter, make_temp_dir, read_json, streaming_parquet, write_json
from ..logutil import Progress
from .token_ids import backend as _backend
from .token_ids import special_token_ids

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
INFO_FILE = "tokenizer_info.json"

log = logging.getLogger("userdp.data.tokenize")

TOKENS_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string()),
        pa.field("example_id", pa.int64()),
        pa.field("split", pa.string()),
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("n_tokens", pa.int32()),
        pa.field("source_example_id", pa.int64()),
    ]
)
PUBLIC_TOKENS_SCHEMA = pa.schema([pa.field("input_ids", pa.list_(pa.int32())), pa.field("n_tokens", pa.int32())])


# ---------------------------------------------------------------- tokenizer


def public_dataset_name(config: dict) -> str | None:
    """`tokenizer.public_dataset`, or the first dataset (config order) with a public part."""
    from .sources import has_public_part

    name = config["tokenizer"].get("public_dataset")
    if name is not None:
        if not has_public_part(config["datasets"][name]):
            raise ConfigError(
                f"tokenizer.public_dataset is {name!r}, but that dataset (source "
                f"{config['datasets'][name].get('source')!r}) has no public part; name a dataset with "
                "public text (e.g. a synthetic or fortunes dataset) or set tokenizer.name."
            )
        return name
    for ds, spec in config["datasets"].items():
        if has_public_part(spec):
            return ds
    return None


def train_bpe(public_path: str | Path, vocab_size: int, out_dir: str | Path, batch_rows: int = 10_000, min_frequency: int = 2) -> dict:
    """Train a byte-level BPE on the public texts in `public_path`; save it in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    clear_stale(out_dir)
    public_path = Path(public_path)
    pf = streaming_parquet(public_path)
    n_texts = pf.metadata.num_rows
    if n_texts == 0:
        raise DataError(f"{public_path}: no public text to train the tokenizer on.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (t for b in pf.iter_batches(batch_size=batch_rows, columns=["text"]) for t in b.column("text").to_pylist())
    tok.train_from_iterator(texts, trainer=trainer, length=n_texts)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    info = {"kind": "bpe", "trained_on": str(public_path), "n_texts": int(n_texts), "requested_vocab_size": vocab_size}
    return _save(hf, out_dir, info)


# The files save_pretrained writes next to tokenizer.json (and our info file): without tokenizer.json (snakemake
# deletes it before rerunning the rule) they are remains of an older tokenizer, removed before a new one is made.
_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
               "tokenizer.model", "chat_template.jinja", INFO_FILE)


def clear_stale(out_dir: str | Path) -> list[Path]:
    """Remove an older tokenizer's files from `out_dir` when its tokenizer.json is gone; return them."""
    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return []
    stale = [out_dir / f for f in _COMPANIONS if (out_dir / f).is_file()]
    for f in stale:
        f.unlink()
    if stale:
        log.info("removed %s: left by an older tokenizer whose tokenizer.json is gone",
                 ", ".join(f.name for f in stale))
    return stale


def load_named(name: str, out_dir: str | Path) -> dict:
    """Load tokenizer `name` (hub name or local path) and save it to `out_dir` with pad/bos set."""
    from transformers import AutoTokenizer

    clear_stale(out_dir)

    try:
        hf = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"tokenizer.name is {name!r}, which could not be loaded ({exc}). Give a Hugging Face hub name "
            "(needs network the first time) or a local folder with tokenizer files, or null to train a BPE."
        ) from exc
    if not getattr(hf, "is_fast", False):
        raise ConfigError(f"tokenizer.name {name!r} has no fast (Rust) tokenizer; tokens need tokenizer.json.")
    # Causal LMs like GPT-2 have only <|endoftext|>: it serves as bos, eos and pad.
    if hf.eos_token is None:
        raise ConfigError(f"tokenizer.name {name!r} has no eos token; choose a causal-LM tokenizer.")
    if hf.bos_token is None:
        hf.bos_token = hf.eos_token
    if hf.pad_token is None:
        hf.pad_token = hf.eos_token
    return _save(hf, out_dir, {"kind": "named", "name": name})


def _save(hf, out_dir: str | Path, info: dict) -> dict:
    """Write a PreTrainedTokenizerFast's files into `out_dir`, each file atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info.update(
        {
            "vocab_size": len(hf),
            "bos_token": hf.bos_token, "eos_token": hf.eos_token, "pad_token": hf.pad_token,
            "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id, "pad_token_id": hf.pad_token_id,
        }
    )
    tmp = make_temp_dir(out_dir / "tokenizer.json")
    try:
        hf.save_pretrained(tmp)
        if not (tmp / "tokenizer.json").exists():
            raise DataError(f"saving the tokenizer to {out_dir} wrote no tokenizer.json")
        # tokenizer.json last: it is the rule's output that marks completion.
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == "tokenizer.json"):
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(out_dir / INFO_FILE, info)
    return info


def load_tokenizer(tok_dir: str | Path):
    """The saved tokenizer as a transformers PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    tok_dir = Path(tok_dir)
    info = read_json(tok_dir / INFO_FILE) if (tok_dir / INFO_FILE).exists() else {}
    path = tok_dir / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"{path} does not exist; rerun snakemake to build it (rule train_tokenizer).")
    try:
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(path),
            bos_token=info.get("bos_token", BOS), eos_token=info.get("eos_token", EOS),
            pad_token=info.get("pad_token", PAD),
        )
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        reason = str(exc).strip()[:200] or type(exc).__name__
        raise DataError(f"{path} is not a readable tokenizer ({reason}): it was truncated or overwritten. It is a "
                        f"pipeline artifact: delete {tok_dir} and rerun snakemake, which rebuilds it and whatever "
                        "depends on it.") from None
    template = chat_template(tok_dir)
    if template is not None:
        tok.chat_template = template
    return tok


def chat_template(tok_dir: str | Path) -> str | None:
    """The chat template saved with a tokenizer (chat_template.jinja, or tokenizer_config.json's), or None."""
    tok_dir = Path(tok_dir)
    jinja = tok_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = tok_dir / "tokenizer_config.json"
    if config.is_file():
        value = read_json(config).get("chat_template")
        if isinstance(value, list):  # named templates: the "default" one is what apply_chat_template uses
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                         None)
        if isinstance(value, str) and value:
            return value
    return None


# ---------------------------------------------------------------- framing


def encode(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts` without special tokens: (flat int32 ids, lengths).

    `encode_batch_fast` (Rayon-parallel, no character offsets) is most of the
    time; reading the ids into numpy is the per-example Python part (reading
    each Encoding's ids once into a list first measured no faster).
    """
    encs = _backend(tok).encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


# Worker processes: each holds its own copy of the tokenizer (built from the
# main process's tokenizer JSON, so it is exactly the tokenizer the main
# process loaded) and encodes whole batches with one Rayon thread; the main
# process only reads, frames and writes, in input order.
_WORKER_TOK = None


def _worker_init(tok_json: str) -> None:
    global _WORKER_TOK
    # Set before the first encode: Rayon sizes its global pool then.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER_TOK = Tokenizer.from_str(tok_json)


def _worker_encode(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    return encode(_WORKER_TOK, texts.to_pylist())


def encoded_batches(
    batches: Iterator[pa.RecordBatch], tok, workers: int = 1
) -> Iterator[tuple[pa.RecordBatch, np.ndarray, np.ndarray]]:
    """(batch, flat ids, lengths) for each batch's `text` column, in input order.

    `workers` <= 1 encodes in this process (Rayon threads as
    RAYON_NUM_THREADS says). Otherwise a pool of `workers` spawned processes
    encodes whole batches: that also parallelises the per-example Python work
    (Encoding objects -> ids) that Rayon cannot. At most 2 * `workers`
    batches are in flight, so memory stays bounded by batch size x workers.
    The result does not depend on `workers`: each batch is encoded as a
    whole by the same tokenizer and results are yielded in submission order.
    Workers are spawned (they import the caller's main script as
    `__mp_main__`), so a script calling this with `workers` > 1 must keep its
    work under `if __name__ == "__main__":`.
    """
    if workers <= 1:
        for batch in batches:
            yield (batch, *encode(tok, batch.column("text").to_pylist()))
        return
    import collections
    import multiprocessing

    from ..workers import process_pool

    # spawn, not fork: a forked child of a process whose Rayon pool or Arrow
    # threads already ran can deadlock (and tokenizers disables itself there).
    ctx = multiprocessing.get_context("spawn")
    log.info("encoding in %d worker processes", workers)
    pending: collections.deque = collections.deque()
    with process_pool(workers, mp_context=ctx, initializer=_worker_init,
                      initargs=(_backend(tok).to_str(),)) as pool:
        try:
            for batch in batches:
                pending.append((batch, pool.submit(_worker_encode, batch.column("text"))))
                if len(pending) >= 2 * workers:
                    done, fut = pending.popleft()
                    yield (done, *fut.result())
            while pending:
                done, fut = pending.popleft()
                yield (done, *fut.result())
        finally:
            for _, fut in pending:
                fut.cancel()


def frame(
    flat: np.ndarray, lengths: np.ndarray, bos: int, eos: int, seq_len: int, mode: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add bos/eos and cut to `seq_len` (truncate) or into windows (chunk).

    Returns (flat output ids, output lengths, source row of each output row).
    """
    n = len(lengths)
    full = lengths + 2
    starts = np.concatenate([[0], np.cumsum(full)[:-1]]).astype(np.int64)
    total = int(full.sum())
    seq = np.empty(total, dtype=np.int32)
    is_tok = np.ones(total, dtype=bool)
    is_tok[starts] = False
    is_tok[starts + full - 1] = False
    seq[is_tok] = flat
    seq[starts] = bos
    seq[starts + full - 1] = eos
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, full)
    if mode == "truncate":
        return seq[pos < seq_len], np.minimum(full, seq_len), np.arange(n)
    if mode != "chunk":
        raise ConfigError(f"tokenizer.long_examples is {mode!r}; allowed values: ['truncate', 'chunk'].")
    n_chunks = -(-full // seq_len)
    row = np.repeat(np.arange(n), n_chunks)
    k = np.arange(len(row)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)  # chunk index in its row
    out_len = np.minimum(seq_len, full[row] - k * seq_len)
    keep = out_len >= 2  # a one-token window has no next-token target
    if keep.all():
        return seq, out_len, row
    chunk_of_tok = np.repeat(np.arange(len(row)), out_len)
    return seq[keep[chunk_of_tok]], out_len[keep], row[keep]


def list_array(flat: np.ndarray, lengths: np.ndarray, value_type: pa.DataType = pa.int32()) -> pa.Array:
    """A list array of `value_type` from flat values and each row's length (token ids, loss masks)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, value_type))


def _schema_with_meta(schema: pa.Schema, tok, seq_len: int, mode: str) -> pa.Schema:
    meta = {
        "vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "sequence_length": seq_len, "long_examples": mode,
    }
    return schema.with_metadata({"userdp": json.dumps(meta)})


def _workers(threads: int, n_rows: int, batch_rows: int) -> int:
    """Worker processes for `threads` CPUs: none (in-process Rayon) for one batch or one thread.

    Spawning workers costs a fraction of a second each (imports, tokenizer),
    which only pays off when there is more than one batch to overlap.
    """
    return threads if threads > 1 and n_rows > batch_rows else 1


def tokenize_examples(
    examples_path: str | Path, tok_dir: str | Path, out_path: str | Path, seq_len: int, mode: str = "truncate",
    batch_rows: int = 10_000, threads: int = 1, log_rows: bool = True,
) -> dict:
    """Write tokens.parquet for examples.parquet, streaming in batches of `batch_rows`.

    `threads` > 1 encodes batches in that many worker processes (see
    `encoded_batches`); the output is byte-identical for any `threads`.
    `log_rows=False` (DP contribution statistics) logs no progress counts: the
    rows include the train users' examples, a statistic of their counts.
    """
    from .chat import Framing

    tok = load_tokenizer(tok_dir)
    bos, eos = special_token_ids(tok)
    pf = streaming_parquet(examples_path)
    kind = Framing.of_examples(pf.schema_arrow)
    if kind != "text":
        return _tokenize_chat(pf, examples_path, tok, out_path, seq_len, mode, kind, batch_rows, log_rows)
    schema = _schema_with_meta(TOKENS_SCHEMA, tok, seq_len, mode)
    n_in = n_out = n_trunc = n_tok = 0
    next_id = 0
    n_rows = pf.metadata.num_rows
    progress = Progress(log, n_rows, f"tokenize {Path(examples_path).parent.name}") if log_rows else None
    batches = pf.iter_batches(batch_size=batch_rows)
    # closing(): an error while writing shuts the worker pool down at once, not at garbage collection.
    encoded = contextlib.closing(encoded_batches(batches, tok, _workers(threads, n_rows, batch_rows)))
    with ParquetBatchWriter(out_path, schema) as writer, encoded as encoded:
        for batch, flat, lengths in encoded:
            if progress is not None:
                progress.update(batch.num_rows)
            ids, out_len, row = frame(flat, lengths, bos, eos, seq_len, mode)
            src_ids = batch.column("example_id").to_numpy()[row]
            if mode == "chunk":
                ex_ids = np.arange(next_id, next_id + len(row), dtype=np.int64)
                next_id += len(row)
            else:
                ex_ids = src_ids
            take = pa.array(row)
            writer.write(
                pa.table(
                    {
                        "user_id": batch.column("user_id").take(take),
                        "example_id": pa.array(ex_ids, pa.int64()),
                        "split": batch.column("split").take(take),
                        "input_ids": list_array(ids, out_len),
                        "n_tokens": pa.array(out_len.astype(np.int32)),
                        "source_example_id": pa.array(src_ids, pa.int64()),
                    },
                    schema=schema,
                )
            )
            n_in += batch.num_rows
            n_out += len(row)
            n_trunc += int((lengths + 2 > seq_len).sum())
            n_tok += int(out_len.sum())
    return {"examples_in": n_in, "examples_out": n_out, "longer_than_sequence_length": n_trunc, "tokens": n_tok,
            "sequence_length": seq_len, "long_examples": mode}


def _tokenize_chat(pf, examples_path: str | Path, tok, out_path: str | Path, seq_len: int, mode: str, kind: str,
                   batch_rows: int, log_rows: bool) -> dict:
    """tokens.parquet of chat or instruction examples (`chat.frame_examples`), with their loss_mask column.

    Framed in this process (the chat template is Python): a conversation is one row, cut to `seq_len`.
    """
    from .chat import LOSS_MASK, chat_template_of, frame_examples, from_text, warn_cut_answers

    if mode != "truncate":
        raise ConfigError(f"tokenizer.long_examples is {mode!r}, but {examples_path} holds {kind} examples: a "
                          "window of a conversation would lose its prompt. Set tokenizer.long_examples: truncate "
                          "(and a tokenizer.sequence_length that holds a conversation).")
    if kind == "messages":
        chat_template_of(tok, "the tokenizer (tokenizer.name, results/tokenizer)")
    schema = _schema_with_meta(TOKENS_SCHEMA.append(pa.field(LOSS_MASK, pa.list_(pa.bool_()))), tok, seq_len, mode)
    n_rows = pf.metadata.num_rows
    progress = Progress(log, n_rows, f"tokenize {Path(examples_path).parent.name}") if log_rows else None
    n_out = n_tok = n_empty = 0
    row0 = 0
    with ParquetBatchWriter(out_path, schema) as writer:
        for batch in pf.iter_batches(batch_size=batch_rows):
            if progress is not None:
                progress.update(batch.num_rows)
            where = [f"{examples_path}, row {row0 + i + 1}" for i in range(batch.num_rows)]
            examples = [from_text(kind, t, w) for t, w in zip(batch.column("text").to_pylist(), where)]
            ids, lengths, mask, empty = frame_examples(tok, kind, examples, seq_len, where=where)
            example_ids = batch.column("example_id")
            writer.write(pa.table({
                "user_id": batch.column("user_id"), "example_id": example_ids, "split": batch.column("split"),
                "input_ids": list_array(ids, lengths), "n_tokens": pa.array(lengths.astype(np.int32)),
                "source_example_id": example_ids, LOSS_MASK: list_array(mask, lengths, pa.bool_()),
            }, schema=schema))
            row0 += batch.num_rows
            n_out += batch.num_rows
            n_tok += int(lengths.sum())
            n_empty += empty
    if log_rows:  # a count of the private rows: not logged with DP contribution statistics
        warn_cut_answers(n_empty, n_out, seq_len)
    return {"examples_in": n_out, "examples_out": n_out, "tokens": n_tok, "sequence_length": seq_len,
            "long_examples": mode, "framing": kind, "without_answer_tokens": n_empty}


def tokenize_public(
    public_path: str | Path, tok_dir: str | Path, out_path: str | Path, seq_len: int, mode: str = "truncate",
    batch_rows: int = 10_000, threads: int = 1,
) -> dict:
    """Write public_tokens.parquet (input_ids, n_tokens) for the public corpus (`threads` as above)."""
    tok = load_tokenizer(tok_dir)
    bos, eos = special_token_ids(tok)
    schema = _schema_with_meta(PUBLIC_TOKENS_SCHEMA, tok, seq_len, mode)
    n_out = n_tok = 0
    pf = streaming_parquet(public_path)
    n_rows = pf.metadata.num_rows
    batches = pf.iter_batches(batch_size=batch_rows, columns=["text"])
    encoded = contextlib.closing(encoded_batches(batches, tok, _workers(threads, n_rows, batch_rows)))
    with ParquetBatchWriter(out_path, schema) as writer, encoded as encoded:
        for _, flat, lengths in encoded:
            ids, out_len, _ = frame(flat, lengths, bos, eos, seq_len, mode)
            writer.write(pa.table({"input_ids": list_array(ids, out_len), "n_tokens": pa.array(out_len.astype(np.int32))}, schema=schema))
            n_out += len(out_len)
            n_tok += int(out_len.sum())
    return {"sequences": n_out, "tokens": n_tok}
