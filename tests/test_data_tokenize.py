"""Tokenizer (trained on public text only) and tokens (truncate / chunk)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userdp.data.prepare import EXAMPLES_SCHEMA
from userdp.data.targets import tokenizer_inputs
from userdp.data.tokenize import (
    encode,
    frame,
    load_tokenizer,
    public_dataset_name,
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
    # The rule's only input is the public corpus of the public dataset.
    config = {"tokenizer": {"name": None, "public_dataset": None},
              "datasets": {"so": {"source": "stackoverflow"}, "synth": {"source": "synthetic"}}}
    assert tokenizer_inputs(config) == {"public": "results/data/synth/public.parquet"}
    assert tokenizer_inputs({**config, "tokenizer": {"name": "gpt2", "public_dataset": None}}) == {}
    with pytest.raises(ConfigError, match="no public part"):
        public_dataset_name({**config, "tokenizer": {"name": None, "public_dataset": "so"}})
    with pytest.raises(ConfigError, match="no dataset has a public part"):
        tokenizer_inputs({"tokenizer": {"name": None, "public_dataset": None}, "datasets": {"so": {"source": "stackoverflow"}}})


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
