"""`userdp.UserDPSFTTrainer`: TRL's SFTTrainer on chat data with user-level DP steps. A model given by its
folder, wrapped by SFTTrainer with a peft LoraConfig, an SFTConfig, TRL-format rows (`messages`, or `prompt` and
`completion`) detected as TRL detects them; the loss on the answers only; SFTTrainer's evaluation metrics;
userdp's card instead of TRL's; the SFTConfig settings that would break the unit of privacy refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from transformers import AutoTokenizer

import userdp
from test_chat_data import chat_checkpoint, chat_frame
from userdp.data import chat
from userdp.errors import ConfigError

trl = pytest.importorskip("trl")

PRIVACY = userdp.PrivacyArguments(method="uls", epsilon=4.0, compute=60, user_column="author",
                                  secret_seeds=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("sft") / "ckpt")


def _config(out, **kw):
    base = dict(output_dir=str(out), learning_rate=1e-3, max_steps=4, max_grad_norm=0.0, save_steps=2,
                logging_steps=2, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, max_length=48)
    base.update(kw)
    return trl.SFTConfig(**base)


def _trainer(ckpt, out, rows=None, privacy=PRIVACY, compute_loss_func=None, **kw):
    from peft import LoraConfig

    return userdp.UserDPSFTTrainer(
        model=str(ckpt), args=_config(out, **kw), train_dataset=chat_frame() if rows is None else rows,
        eval_dataset=chat_frame(6, seed=9), processing_class=AutoTokenizer.from_pretrained(ckpt),
        peft_config=LoraConfig(r=4, target_modules="all-linear"), privacy=privacy,
        compute_loss_func=compute_loss_func)


@pytest.mark.integration
def test_sft_on_chat_rows_trains_the_answers_evaluates_and_releases(ckpt, tmp_path):
    from peft import PeftModel

    rows = chat_frame()[["author", "messages"]]
    trainer = _trainer(ckpt, tmp_path / "out", rows=rows)
    assert isinstance(trainer.model, PeftModel)  # SFTTrainer wrapped it with peft_config
    assert trainer.privacy.messages_column == "messages"  # TRL's conversational column, detected
    # the pool's targets are the assistant tokens of each conversation, as userdp frames them
    tok = trainer._tok
    ids, lengths, mask, _ = chat.frame_examples(tok, "messages", [list(m) for m in rows["messages"]], 48)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    pool = trainer._pool
    for r in range(pool.n_examples):  # each pool row: its own row's tokens and answer mask (example id = row)
        e = int(pool.example_ids[r])
        assert pool.tokens(r).tolist() == ids[starts[e]:starts[e + 1]].tolist()
        assert pool.loss_mask(r).tolist() == mask[starts[e]:starts[e + 1]].tolist()
    trainer.train()
    assert not (tmp_path / "out" / "README.md").exists()  # TRL's card (no DP facts) is never written
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4] and all(math.isfinite(h["loss"]) for h in logged)
    assert logged[-1]["epsilon"] == pytest.approx(trainer.spec.epsilon_achieved, rel=1e-9)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and 0 <= metrics["eval_mean_token_accuracy"] <= 1
    trainer.save_model()
    out = tmp_path / "out"
    ledger = userdp.read_ledger(out)
    assert ledger["complete"] and ledger["steps_completed"] == 4 and ledger["method"] == "uls"
    assert userdp.epsilon(ledger) == pytest.approx(ledger["epsilon"], rel=1e-12)
    card = (out / "README.md").read_text()
    assert "user-level-dp" in card and "library_name: peft" in card
    model, facts = userdp.load_released(out, with_card=True)
    assert facts["epsilon"] == ledger["epsilon"]


@pytest.mark.integration
def test_prompt_completion_rows_are_detected_and_evaluated_on_the_completion(ckpt, tmp_path):
    rows = chat_frame()[["author", "prompt", "completion"]]
    trainer = _trainer(ckpt, tmp_path / "pc", rows=rows, max_steps=2, save_steps=10)
    assert (trainer.privacy.prompt_column, trainer.privacy.completion_column) == ("prompt", "completion")
    trainer.train()
    metrics = trainer.evaluate(chat_frame(6, seed=9)[["author", "prompt", "completion"]])
    assert math.isfinite(metrics["eval_loss"])


@pytest.mark.parametrize("kw,message", [
    ({"packing": True}, r"SFTConfig\.packing is True: a packed sequence holds examples of several users"),
    ({"padding_free": True}, r"SFTConfig\.padding_free is True"),
    ({"max_grad_norm": 1.0}, r"TrainingArguments\.max_grad_norm is 1\.0"),
    ({"gradient_accumulation_steps": 2}, r"gradient_accumulation_steps is 2"),
    ({"loss_type": "dft"}, r"SFTConfig\.loss_type is 'dft': UserDPSFTTrainer's DP step computes its own loss"),
    ({"label_smoothing_factor": 0.1}, r"SFTConfig\.label_smoothing_factor is 0\.1"),
    ({"truncation_mode": "keep_end"}, r"SFTConfig\.truncation_mode is 'keep_end'"),
])
def test_settings_that_break_the_unit_are_refused(ckpt, tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        _trainer(ckpt, tmp_path / "bad", **kw)


def test_a_custom_loss_function_is_refused(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="compute_loss_func is given"):
        _trainer(ckpt, tmp_path / "bad", compute_loss_func=lambda *a, **k: 0.0)


def test_completion_only_loss_false_on_instruction_rows_is_refused(ckpt, tmp_path):
    rows = chat_frame()[["author", "prompt", "completion"]]
    with pytest.raises(ConfigError, match=r"SFTConfig\.completion_only_loss is False"):
        _trainer(ckpt, tmp_path / "bad", rows=rows, completion_only_loss=False)
