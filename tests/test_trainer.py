"""`userdp.UserDPTrainer` with a real `TrainingArguments`: trains T = max_steps noisy steps, logs the loss and
the epsilon through Trainer's logging, resumes from Trainer's checkpoints continuing the secret sampling and noise
streams (the resumed run's units and noise equal an uninterrupted run's with the same secret state; the state file
is 0600 and deleted at the end), evaluates, saves a folder `load_released` and `read_ledger` read; the
TrainingArguments that would change the mechanism are refused."""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, TrainingArguments

import userdp
from test_api import checkpoint, users_frame
from userdp.errors import ConfigError, DataError
from userdp.trainer import STATE_FILE


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("trainer") / "ckpt")


def _model(ckpt: Path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(str(ckpt)), LoraConfig(r=4, target_modules="all-linear"))


def _args(out: Path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), learning_rate=1e-3, max_steps=8, max_grad_norm=0.0, save_steps=4,
                logging_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


PRIVACY = userdp.PrivacyArguments(method="els", epsilon=4.0, compute=400, user_column="author", text_column="body")


def _trainer(ckpt, out, model=None, observe=None, callbacks=None, privacy=PRIVACY, **kw):
    import datasets

    return userdp.UserDPTrainer(model=model or _model(ckpt), args=_args(out, **kw),
                                train_dataset=datasets.Dataset.from_pandas(users_frame(60)),
                                eval_dataset=users_frame(12, seed=9), processing_class=AutoTokenizer.from_pretrained(
                                    str(ckpt)), privacy=privacy, observe=observe, callbacks=callbacks)


@pytest.mark.integration
def test_train_logs_evaluates_and_saves_a_released_folder(ckpt, tmp_path):
    trainer = _trainer(ckpt, tmp_path / "out")
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4, 6, 8]
    eps = [h["epsilon"] for h in logged]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(trainer.spec.epsilon_achieved, rel=1e-9)
    assert all(np.isfinite(h["loss"]) for h in logged)
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"])
    trainer.save_model()
    out = tmp_path / "out"
    ledger = userdp.read_ledger(out)
    assert ledger["steps_completed"] == 8 and ledger["complete"] and ledger["method"] == "els"
    assert userdp.epsilon(ledger) == pytest.approx(eps[-1], rel=1e-12) and ledger["seeds_mode"] == "secret"
    assert ledger["optimizer"].endswith("(Trainer's)") and ledger["optimizer"].startswith("adamw")
    model, facts = userdp.load_released(out, with_card=True)
    assert facts["epsilon"] == ledger["epsilon"] and "user-level-dp" in (out / "README.md").read_text()
    assert not list(out.glob(f"checkpoint-*/{STATE_FILE}"))  # the secret state is gone with the run complete
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _patch_secret(monkeypatch, start: int) -> None:
    """Secret seeds from a fixed sequence: two runs with the same `start` have the same secret state."""
    from userdp.training import run_seeds

    values = itertools.count(start)
    monkeypatch.setattr(run_seeds.secrets, "randbits", lambda bits: next(values))


def _record(seen: list):
    return lambda o: seen.append((o.step, o.selection.rows.tolist(), [n.clone() for n in o.noise]))


@pytest.mark.integration
def test_a_resumed_run_continues_the_secret_streams(ckpt, tmp_path, monkeypatch):
    whole: list = []
    _patch_secret(monkeypatch, 1000)
    uninterrupted = _trainer(ckpt, tmp_path / "a", observe=_record(whole))
    uninterrupted.train()

    first: list = []
    _patch_secret(monkeypatch, 1000)  # the same secret state as the uninterrupted run
    part = _trainer(ckpt, tmp_path / "b", observe=_record(first), callbacks=[_StopAt(4)])
    part.train()
    state = tmp_path / "b" / "checkpoint-4" / STATE_FILE
    assert part._dp.steps_done == 4 and state.is_file()
    assert stat.S_IMODE(state.stat().st_mode) == 0o600

    # a resume under another plan (here T = 12: more steps than accounted) is refused, the state left as it is
    with pytest.raises(DataError, match="belongs to another plan"):
        _trainer(ckpt, tmp_path / "b", max_steps=12).train(resume_from_checkpoint=str(state.parent))
    assert state.is_file()

    rest: list = []
    _patch_secret(monkeypatch, 5000)  # fresh secrets at the restart: the checkpoint's streams must win
    resumed = _trainer(ckpt, tmp_path / "b", observe=_record(rest))
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    got = first + rest
    assert [s for s, _, _ in got] == list(range(1, 9))
    for (step, rows_a, noise_a), (_, rows_b, noise_b) in zip(whole, got):
        assert rows_a == rows_b, step  # the same sampled units
        assert all(torch.equal(x, y) for x, y in zip(noise_a, noise_b)), step  # the same noise
    a = uninterrupted.model.state_dict()
    b = resumed.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not list((tmp_path / "b").glob(f"checkpoint-*/{STATE_FILE}"))  # deleted when the T-th step is done
    with pytest.raises(DataError, match=f"holds no {STATE_FILE}"):  # and so never re-used
        _trainer(ckpt, tmp_path / "b").train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))


@pytest.mark.parametrize("kw,match", [
    ({"max_grad_norm": 1.0}, r"TrainingArguments.max_grad_norm is 1.0 .*Set max_grad_norm=0"),
    ({"gradient_accumulation_steps": 2}, r"gradient_accumulation_steps is 2: .*Set gradient_accumulation_steps=1"),
    ({"max_steps": -1}, r"TrainingArguments.max_steps is not set"),
])
def test_arguments_that_change_the_mechanism_are_refused(ckpt, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        _trainer(ckpt, tmp_path / "out", **kw)


def test_a_second_clipping_by_default_is_refused(ckpt, tmp_path):
    """transformers' default max_grad_norm (1.0) is a second clipping: it must be switched off explicitly."""
    assert TrainingArguments(output_dir=str(tmp_path)).max_grad_norm > 0
    with pytest.raises(ConfigError, match="max_grad_norm"):
        userdp.UserDPTrainer(model=_model(ckpt), args=TrainingArguments(output_dir=str(tmp_path), max_steps=4,
                                                                        report_to=[], use_cpu=True),
                             train_dataset=users_frame(20), processing_class=AutoTokenizer.from_pretrained(str(ckpt)),
                             privacy=PRIVACY)
