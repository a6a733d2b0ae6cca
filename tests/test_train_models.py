"""Models built from config, pretraining on public tokens, atomic saving."""

from __future__ import annotations


import pyarrow.parquet as pq
import pytest
import torch

from train_fixtures import SEQ, make_tokenizer, public_tokens_table, tiny_model
from userdp.config import validate_config
from userdp.errors import ConfigError, DataError
from userdp.training.models import build_model, load_model, load_tokenizer, resolve_device, save_model_atomic, special_ids
from userdp.training.pretrain import pretrain


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tie", [True, False])
def test_build_model_from_config(arch, tie):
    model = tiny_model(arch, tie)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (emb.data_ptr() == head.data_ptr()) is tie
    assert emb.shape[0] == 40
    out = model(input_ids=torch.randint(3, 40, (2, SEQ)))
    assert out.logits.shape == (2, SEQ, 40)
    # deterministic init from the seed
    assert torch.equal(tiny_model(arch, tie, seed=0).get_input_embeddings().weight, emb)


def test_build_model_rejects_bad_heads():
    with pytest.raises(ConfigError, match="n_head"):
        build_model({"architecture": "gpt2", "n_layer": 1, "n_embd": 10, "n_head": 3}, 40, SEQ, {}, seed=0)


def test_pretrain_learns_and_saves_atomically(tmp_path):
    vocab = make_tokenizer(tmp_path / "tokenizer")
    tok = load_tokenizer(tmp_path / "tokenizer" / "tokenizer.json")
    assert len(tok) == vocab and special_ids(tok)["pad_token_id"] is not None
    public = tmp_path / "public_tokens.parquet"
    pq.write_table(public_tokens_table(vocab), public)
    config = validate_config({
        "datasets": {"tiny": {"source": "synthetic"}},
        "tokenizer": {"sequence_length": SEQ},
        "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "pretrain": {"steps": 60, "batch_size": 16,
                                                                        "learning_rate": 0.01}},
    })
    out = tmp_path / "model" / "pretrained"
    out.mkdir(parents=True)  # Snakemake creates output folders before the job
    info = pretrain(config, tmp_path / "tokenizer", public, out)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors"}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    # it learned the public pattern: far below the uniform-guess loss log(vocab)
    assert info["final_loss"] < 0.6 * torch.log(torch.tensor(float(vocab))).item()
    model = load_model(out)
    assert model.config.n_positions == SEQ and model.config.vocab_size == vocab
    # a second save replaces the folder
    save_model_atomic(model, out)
    assert torch.equal(load_model(out).get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(DataError):
        load_model(tmp_path / "nothing")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="training.device"):
            resolve_device("cuda")
    assert resolve_device("cpu").type == "cpu"


def test_saved_model_is_readable_like_other_artifacts_and_missing_folder_is_named(tmp_path):
    import os
    import stat

    save_model_atomic(tiny_model(), tmp_path / "model")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o777 & ~umask
    for f in (tmp_path / "model").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
    with pytest.raises(DataError, match=r"nonexistent_model: the folder does not exist"):
        load_model(tmp_path / "nonexistent_model")
