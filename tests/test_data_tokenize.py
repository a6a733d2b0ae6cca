"""Tokenizer (trained on public text only) and tokens (truncate / chunk)."""

from __future__ import annotations

import json
import shutil
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userdp.data.prepare import EXAMPLES_SCHEMA
from userdp.data.tokenize import (
    encode,
    frame,
    load_tokenizer,
    public_dataset_name,
    load_named,
    tokenize_examples,
    tokenize_public,
    train_bpe,
)
from userdp.errors import ConfigError

PUBLIC = ["the cat sat on the mat .", "a dog ran in the park .", "the bird sang a song ."] * 200
SECRET = "zyxwvutsrq"  # appears only in private text


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    pq.write_table(pa.table({"text": PUBLIC}), d / "public.parquet")
    train_bpe(d / "public.parquet", 300, d / "tokenizer", batch_rows=50)
    return d / "tokenizer"


def test_frame_truncate():
    flat = np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32)
    lengths = np.array([2, 5, 0])
    ids, lens, row = frame(flat, lengths, bos=0, eos=1, seq_len=4, mode="truncate")
    assert lens.tolist() == [4, 4, 2]
    assert ids.tolist() == [0, 5, 6, 1, 0, 7, 8, 9, 0, 1]  # the cut example loses its eos
    assert row.tolist() == [0, 1, 2]


def test_frame_chunk_keeps_every_token():
    flat = np.arange(10, 19, dtype=np.int32)  # 9 tokens
    lengths = np.array([2, 7])
    ids, lens, row = frame(flat, lengths, bos=0, eos=1, seq_len=3, mode="chunk")
    # row 0: [0 10 11 1] -> [0 10 11] [1] (the 1-token window is dropped)
    # row 1: [0 12..18 1] (9 tokens) -> 3 windows of 3
    assert lens.tolist() == [3, 3, 3, 3]
    assert row.tolist() == [0, 1, 1, 1]
    assert ids.tolist() == [0, 10, 11, 0, 12, 13, 14, 15, 16, 17, 18, 1]
    with pytest.raises(ConfigError, match="long_examples"):
        frame(flat, lengths, 0, 1, 3, "wrap")


def test_tokenizer_is_trained_on_public_text_only(tok_dir):
    info = json.loads((tok_dir / "tokenizer_info.json").read_text())
    assert info["trained_on"].endswith("public.parquet") and info["n_texts"] == len(PUBLIC)
    tok = load_tokenizer(tok_dir)
    # Public words became single tokens; a private-only word did not get merges.
    assert len(tok.tokenize(" cat")) == 1
    assert len(tok.tokenize(" " + SECRET)) >= len(SECRET) - 1
    # The public dataset is the first with a public part (the rule's only input is its public corpus:
    # tests/test_rules.py); naming one without refuses.
    config = {"tokenizer": {"name": None, "public_dataset": None},
              "datasets": {"so": {"source": "stackoverflow"}, "synth": {"source": "synthetic"}}}
    assert public_dataset_name(config) == "synth"
    with pytest.raises(ConfigError, match="no public part"):
        public_dataset_name({**config, "tokenizer": {"name": None, "public_dataset": "so"}})
    assert public_dataset_name({**config, "datasets": {"so": {"source": "stackoverflow"}}}) is None


def test_tokenizer_folder_loads_with_transformers(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    text = "the dog sat on a mat ."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_bpe_training_is_deterministic(tmp_path, tok_dir):
    pq.write_table(pa.table({"text": PUBLIC}), tmp_path / "public.parquet")
    train_bpe(tmp_path / "public.parquet", 300, tmp_path / "again", batch_rows=77)
    a = json.loads((tok_dir / "tokenizer.json").read_text())["model"]
    b = json.loads((tmp_path / "again" / "tokenizer.json").read_text())["model"]
    assert a == b


def examples_table(texts, users=None):
    n = len(texts)
    return pa.table(
        {
            "user_id": users or [f"u{i % 3}" for i in range(n)],
            "example_id": pa.array(np.arange(100, 100 + n), pa.int64()),
            "split": ["train"] * n,
            "text": texts,
        },
        schema=EXAMPLES_SCHEMA,
    )


def test_tokens_truncate(tmp_path, tok_dir):
    texts = ["the cat sat .", "the dog ran in the park and the bird sang a song on the mat ."]
    pq.write_table(examples_table(texts), tmp_path / "examples.parquet")
    info = tokenize_examples(tmp_path / "examples.parquet", tok_dir, tmp_path / "tokens.parquet", seq_len=8, batch_rows=1)
    t = pq.read_table(tmp_path / "tokens.parquet")
    assert t.schema.names == ["user_id", "example_id", "split", "input_ids", "n_tokens", "source_example_id"]
    assert t.schema.field("input_ids").type == pa.list_(pa.int32())
    tok = load_tokenizer(tok_dir)
    rows = t.to_pylist()
    assert rows[0]["input_ids"][0] == tok.bos_token_id and rows[0]["input_ids"][-1] == tok.eos_token_id
    assert tok.decode(rows[0]["input_ids"][1:-1]) == "the cat sat ."
    assert rows[1]["n_tokens"] == 8 == len(rows[1]["input_ids"]) and rows[1]["input_ids"][-1] != tok.eos_token_id
    assert [r["example_id"] for r in rows] == [100, 101]
    assert info["longer_than_sequence_length"] == 1
    meta = json.loads(t.schema.metadata[b"userdp"])
    assert meta["sequence_length"] == 8 and meta["vocab_size"] == len(tok)


def test_tokens_chunk_new_ids_same_user(tmp_path, tok_dir):
    long = "the dog ran in the park and the bird sang a song on the mat ."
    pq.write_table(examples_table(["the cat sat .", long], users=["alice", "bob"]), tmp_path / "examples.parquet")
    tokenize_examples(tmp_path / "examples.parquet", tok_dir, tmp_path / "tokens.parquet", seq_len=6, mode="chunk")
    t = pq.read_table(tmp_path / "tokens.parquet").to_pylist()
    ids = [r["example_id"] for r in t]
    assert len(set(ids)) == len(ids) and len(t) > 2
    assert {r["user_id"] for r in t if r["source_example_id"] == 101} == {"bob"}
    tok = load_tokenizer(tok_dir)
    joined = [i for r in t if r["source_example_id"] == 101 for i in r["input_ids"]]
    flat, _ = encode(tok, [long])
    assert joined == [tok.bos_token_id, *flat.tolist(), tok.eos_token_id]  # nothing lost
    assert all(r["n_tokens"] <= 6 for r in t)


def test_public_tokens(tmp_path, tok_dir):
    pq.write_table(pa.table({"text": PUBLIC[:10]}), tmp_path / "public.parquet")
    info = tokenize_public(tmp_path / "public.parquet", tok_dir, tmp_path / "pt.parquet", seq_len=16)
    t = pq.read_table(tmp_path / "pt.parquet")
    assert t.schema.names == ["input_ids", "n_tokens"] and t.num_rows == 10 == info["sequences"]


def test_named_tokenizer_from_local_folder_gets_pad_and_bos(tmp_path, tok_dir):
    """A GPT-2-like tokenizer with only an eos token: eos also serves as bos and pad."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from userdp.data.tokenize import load_named

    base = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token="<|eos|>")
    assert base.pad_token is None and base.bos_token is None
    base.save_pretrained(tmp_path / "eos_only")
    info = load_named(str(tmp_path / "eos_only"), tmp_path / "out")
    assert info["kind"] == "named" and info["pad_token"] == info["bos_token"] == "<|eos|>"
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.pad_token_id == tok.eos_token_id == tok.bos_token_id
    with pytest.raises(ConfigError, match="tokenizer.name"):
        load_named(str(tmp_path / "does-not-exist"), tmp_path / "out2")


# ------------------------------------------------ fast path: workers, identity

MIXED = [
    "the cat sat on the mat .",
    "",  # empty text: [bos, eos]
    "the dog ran in the park and the bird sang a song on the mat . " * 3,  # long: truncated / 3+ windows
    "a <|eos|> inside <|bos|> text",  # special-token strings in the text stay special tokens, as before
    "zyxwvutsrq ünïcödé ✓ 東京",
    "the bird sang .",
]


def _old_encode(tok, texts):
    """The previous implementation's encode (ids read twice through generators): the byte-identity baseline."""
    import itertools

    encs = tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _reference_rows(tok, texts, example_ids, users, seq_len, mode):
    """Rows tokens.parquet must hold, in plain Python (one `encode` per text, list slicing)."""
    rows, next_id = [], 0
    for text, ex, user in zip(texts, example_ids, users):
        seq = [tok.bos_token_id, *tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, tok.eos_token_id]
        windows = [seq[:seq_len]] if mode == "truncate" else [seq[i:i + seq_len] for i in range(0, len(seq), seq_len)]
        for w in windows:
            if mode == "chunk" and len(w) < 2:
                continue
            eid = ex if mode == "truncate" else next_id
            next_id += mode == "chunk"
            rows.append({"user_id": user, "example_id": eid, "split": "train", "input_ids": w, "n_tokens": len(w),
                         "source_example_id": ex})
    return rows


@pytest.mark.parametrize("mode", ["truncate", "chunk"])
def test_tokens_identical_to_old_implementation_and_any_worker_count(tmp_path, tok_dir, mode, monkeypatch):
    """threads=1 and threads=2 (worker processes) write the same bytes as the previous implementation,
    whose rows match a plain-Python reference (special tokens, empty, long and non-ASCII texts)."""
    import userdp.data.tokenize as tz

    texts = MIXED * 7  # 42 rows in batches of 5: several batches, a short last one
    users = [f"u{i % 4}" for i in range(len(texts))]
    pq.write_table(examples_table(texts, users), tmp_path / "examples.parquet", row_group_size=11)
    args = dict(seq_len=8, mode=mode, batch_rows=5)
    with monkeypatch.context() as m:
        m.setattr(tz, "encode", _old_encode)  # the in-process path encodes through the module global
        old_info = tokenize_examples(tmp_path / "examples.parquet", tok_dir, tmp_path / "old.parquet", **args)
    info1 = tokenize_examples(tmp_path / "examples.parquet", tok_dir, tmp_path / "t1.parquet", **args, threads=1)
    info2 = tokenize_examples(tmp_path / "examples.parquet", tok_dir, tmp_path / "t2.parquet", **args, threads=2)
    old = (tmp_path / "old.parquet").read_bytes()
    assert (tmp_path / "t1.parquet").read_bytes() == old
    assert (tmp_path / "t2.parquet").read_bytes() == old
    assert old_info == info1 == info2
    tok = load_tokenizer(tok_dir)
    expected = _reference_rows(tok, texts, list(range(100, 100 + len(texts))), users, 8, mode)
    assert pq.read_table(tmp_path / "t2.parquet").to_pylist() == expected
    assert info2["examples_out"] == len(expected) > (len(texts) if mode == "chunk" else len(texts) - 1)
    # The special-token strings in text 3 became the special ids themselves.
    special = _reference_rows(tok, [MIXED[3]], [0], ["u"], 64, "truncate")[0]["input_ids"]
    assert special.count(tok.eos_token_id) == 2 and special.count(tok.bos_token_id) == 2


def test_public_tokens_identical_for_any_worker_count(tmp_path, tok_dir):
    texts = MIXED * 5
    pq.write_table(pa.table({"text": texts}), tmp_path / "public.parquet")
    info1 = tokenize_public(tmp_path / "public.parquet", tok_dir, tmp_path / "p1.parquet", seq_len=8, mode="chunk",
                            batch_rows=4, threads=1)
    info2 = tokenize_public(tmp_path / "public.parquet", tok_dir, tmp_path / "p2.parquet", seq_len=8, mode="chunk",
                            batch_rows=4, threads=2)
    assert (tmp_path / "p1.parquet").read_bytes() == (tmp_path / "p2.parquet").read_bytes()
    assert info1 == info2
    tok = load_tokenizer(tok_dir)
    expected = [r["input_ids"] for r in _reference_rows(tok, texts, range(len(texts)), ["u"] * len(texts), 8, "chunk")]
    assert pq.read_table(tmp_path / "p2.parquet").column("input_ids").to_pylist() == expected


def test_encoded_batches_keeps_order_and_bounds_in_flight_batches(tok_dir):
    """Worker results come back in input order, with at most 2 x workers batches read ahead."""
    from userdp.data.tokenize import encoded_batches

    tok = load_tokenizer(tok_dir)
    texts = [f"the cat {'sat ' * (i % 5)}." for i in range(40)]
    read = []

    def batches():
        for i in range(0, len(texts), 4):
            read.append(i)
            yield pa.record_batch({"text": texts[i:i + 4]})

    seen = []
    for k, (batch, flat, lengths) in enumerate(encoded_batches(batches(), tok, workers=2)):
        assert len(read) <= k + 1 + 2 * 2  # bounded read-ahead
        assert batch.column("text").to_pylist() == texts[4 * k:4 * k + 4]
        ref_flat, ref_len = encode(tok, texts[4 * k:4 * k + 4])
        assert flat.tolist() == ref_flat.tolist() and lengths.tolist() == ref_len.tolist()
        seen.append(k)
    assert seen == list(range(10))


def test_error_mid_stream_leaves_no_output_and_no_workers(tmp_path, tok_dir, monkeypatch):
    import multiprocessing

    import userdp.data.tokenize as tz

    pq.write_table(examples_table(MIXED * 4), tmp_path / "examples.parquet")
    calls, real_frame = [], tz.frame

    def failing_frame(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return real_frame(*args, **kwargs)

    monkeypatch.setattr(tz, "frame", failing_frame)
    try:
        tokenize_examples(tmp_path / "examples.parquet", tok_dir, tmp_path / "tokens.parquet", seq_len=8,
                          batch_rows=3, threads=2)
    except RuntimeError as exc:
        assert "disk full" in str(exc)
        # While the traceback (and the generator in its frames) is still alive: the pool is gone.
        assert multiprocessing.active_children() == []
    else:
        raise AssertionError("the error in frame() did not propagate")
    assert not (tmp_path / "tokens.parquet").exists()


KILLED_CHILD = r"""
import sys, time
from pathlib import Path
import userdp.data.tokenize as t

ex, tok, out, ready = sys.argv[1:5]
orig = t.frame

def slow_frame(*a, **k):  # keeps the job in progress (workers alive, temp file open) until it is killed
    Path(ready).write_text("1")
    time.sleep(0.5)
    return orig(*a, **k)

t.frame = slow_frame
if __name__ == "__main__":
    t.tokenize_examples(ex, tok, out, seq_len=8, batch_rows=5, threads=2)
"""


@pytest.mark.integration
def test_kill_9_of_tokenize_ends_its_workers_and_the_rerun_removes_its_temp_file(tmp_path, tok_dir):
    """Workers die with their parent (userdp.workers); the killed job's .tokens.parquet.*.tmp goes at the rerun."""
    import signal
    import subprocess
    import sys

    from proc_helpers import group_alive, group_members, wait_for

    pq.write_table(examples_table(["the cat sat on the mat ."] * 200), tmp_path / "examples.parquet")
    script = tmp_path / "child.py"
    script.write_text(KILLED_CHILD)
    out, ready = tmp_path / "tokens.parquet", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "examples.parquet"), str(tok_dir),
                             str(out), str(ready)], start_new_session=True)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 120, "tokenize to start")
        assert proc.poll() is None, "tokenize ended before it was killed"
        assert len(group_members(proc.pid)) >= 3, "expected the job and its 2 workers"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not group_alive(proc.pid), 30, "the workers to end with their killed parent (they outlived it)")
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tokens.parquet.")]
    assert len(leftovers) == 1 and f"-{proc.pid}." in leftovers[0]
    tokenize_examples(tmp_path / "examples.parquet", tok_dir, out, seq_len=8, batch_rows=50)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tokens.parquet.")]
    assert pq.read_table(out).num_rows == 200



def test_a_failed_tokenizer_load_leaves_no_stale_companions(tmp_path, tok_dir):
    """snakemake deletes tokenizer.json before rerunning the rule; a failing load must not leave the old
    tokenizer's other files behind (a folder that half describes a tokenizer), and a good one replaces them."""
    out = tmp_path / "tokenizer"
    shutil.copytree(tok_dir, out)
    (out / "tokenizer.json").unlink()
    assert (out / "tokenizer_config.json").exists()
    with pytest.raises(ConfigError, match="tokenizer.name is"):
        load_named(str(tmp_path / "no-such-tokenizer"), out)
    assert sorted(p.name for p in out.iterdir()) == []
    load_named(str(tok_dir), out)
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
