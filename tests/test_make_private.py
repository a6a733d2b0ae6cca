"""`userdp.make_private`: the issue's snippet as written (ELS and ULS, LoRA via LoraConfig and full fine-tuning),
its epsilon re-accounted from the saved ledger's event, one engine with `fine_tune` (same inputs and seeds, the
same model and ledger), the replay on neighbouring datasets through it, and every refusal of a silent failure
with its message.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import userdp
from test_api import checkpoint, users_frame
from userdp.errors import ConfigError, PrivacyError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("make-private") / "ckpt")


def snippet(path: str, method: str, lora: bool) -> str:
    """The issue's acceptance snippet (docs/api.md), with the checkpoint, the method and LoRA or not."""
    wrap = ('get_peft_model(AutoModelForCausalLM.from_pretrained("{p}"), LoraConfig(r=8, target_modules="all-linear"))'
            if lora else 'AutoModelForCausalLM.from_pretrained("{p}")').format(p=path)
    return textwrap.dedent(f"""\
        import torch, userdp
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained("{path}")
        model = {wrap}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        dp = userdp.make_private(model, optimizer, data=rows, user_column="author", text_column="body", tokenizer=tok,
                                 method="{method}", epsilon=4.0, compute=2000, steps=20)
        for _ in range(dp.spec.steps):
            stats = dp.step()          # one noisy step: Poisson sample, clip per unit, noise once, optimizer.step()
        print(dp.epsilon, dp.spec.noise_multiplier, dp.spec.group_size, stats.loss)
        dp.save("out/own-loop")        # the released model (adapter), ledger.json, README.md model card
        """)


def test_the_snippet_is_the_one_in_docs():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    code = snippet("path/to/checkpoint", "uls", True)
    for line in code.splitlines():
        assert line.strip() in text, f"docs/api.md lacks the snippet line {line!r}"


@pytest.mark.integration
@pytest.mark.parametrize("method,lora", [("uls", True), ("els", True), ("els", False), ("uls", False)])
def test_the_snippet_runs_and_its_epsilon_is_the_released_guarantee(ckpt, tmp_path, monkeypatch, capsys, method,
                                                                     lora):
    monkeypatch.chdir(tmp_path)
    scope = {"rows": users_frame()}
    exec(compile(snippet(str(ckpt), method, lora), "snippet", "exec"), scope)
    dp, stats = scope["dp"], scope["stats"]
    printed = capsys.readouterr().out.split()
    assert float(printed[0]) == dp.epsilon and float(printed[1]) == dp.spec.noise_multiplier
    assert int(printed[2]) == dp.spec.group_size and float(printed[3]) == stats.loss
    out = tmp_path / "out" / "own-loop"
    ledger = userdp.read_ledger(out)
    # the saved ledger's event, re-accounted by the PLD accountant, is the printed guarantee, <= the target
    assert userdp.epsilon(ledger) == pytest.approx(dp.epsilon, rel=1e-12) and ledger["epsilon"] == dp.epsilon
    assert dp.epsilon <= 4.0 + 1e-9 and dp.epsilon == pytest.approx(dp.spec.epsilon_achieved, rel=1e-9)
    assert ledger["complete"] and ledger["steps_completed"] == 20 == dp.steps_done
    assert ledger["seeds_mode"] == "secret" and ledger["seeds"]["sampler"] == "secret"
    assert ledger["method"] == method and ledger["optimizer"] == "AdamW (the caller's)"
    assert "loss_tokens" not in ledger  # text rows: the loss is on every token, the ledger as before
    # the sampling the plan accounted for is the one that ran; no user over G in the pool
    counts = users_frame()["author"].value_counts().to_numpy()
    assert ledger["sampling_rate"] == dp.spec.sampling_rate
    assert ledger["n_pool_examples"] == int(np.minimum(counts, dp.spec.group_size).sum())
    assert ledger["expected_batch"] == pytest.approx(dp.spec.expected_batch, rel=1e-9)
    assert (ledger["adapter"] is not None) == lora == (out / "model" / "adapter_config.json").exists()
    # the model card beside the ledger and in the model folder (replacing peft's empty template)
    card = (out / "README.md").read_text()
    assert (out / "model" / "README.md").read_text() == card and "user-level-dp" in card
    assert f"| epsilon | {dp.epsilon:.4g} |" in card
    assert userdp.RunSpec.load(out / "plan.json") == dp.spec
    model, released, facts = userdp.load_released(out, with_ledger=True, with_card=True)
    assert released == ledger and not hasattr(model, "peft_config")
    assert facts["epsilon"] == dp.epsilon and facts["group_size"] == dp.spec.group_size
    assert facts["privacy_unit"] in card and facts["seeds_mode"] == "secret"


def _rows_and_model(ckpt: Path, lora: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    return users_frame(30), model, AutoTokenizer.from_pretrained(str(ckpt))


def _private(ckpt, model=None, optimizer=None, **kw):
    rows, built, tok = _rows_and_model(ckpt)
    model = built if model is None else model
    optimizer = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    args = dict(data=rows, user_column="author", text_column="body", tokenizer=tok, method="els", epsilon=4.0,
                steps=3)
    args.update(kw)
    args.setdefault("compute", 30 * (args["steps"] or 3))  # about 30 of the 78 bounded examples a step
    return userdp.make_private(model, optimizer, **args)


# ---------------------------------------------------------------- refusals of silent failures


def test_an_optimizer_missing_trainable_parameters_is_refused(ckpt):
    _, model, _ = _rows_and_model(ckpt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ConfigError, match=r"does not update 1 of the model's \d+ trainable parameters \(.*lora_"):
        _private(ckpt, model, torch.optim.SGD(trainable[1:], lr=0.1))


def test_an_optimizer_over_frozen_parameters_is_refused(ckpt):
    _, model, _ = _rows_and_model(ckpt)
    frozen = [p for p in model.parameters() if not p.requires_grad][:1]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad] + frozen, lr=0.1)
    with pytest.raises(ConfigError, match="updates 1 tensor\\(s\\) that are not trainable parameters"):
        _private(ckpt, model, opt)


def test_gradients_already_present_are_refused(ckpt):
    _, model, _ = _rows_and_model(ckpt)
    model(input_ids=torch.tensor([[1, 5, 7]]), labels=torch.tensor([[1, 5, 7]])).loss.backward()
    with pytest.raises(ConfigError, match="already hold a gradient before make_private .*remove the loss.backward"):
        _private(ckpt, model)


def test_a_backward_between_steps_is_refused(ckpt):
    dp = _private(ckpt)
    dp.step()
    assert all(p.grad is None for p in dp.model.parameters())  # the step leaves no gradient behind
    dp.model(input_ids=torch.tensor([[1, 5, 7]]), labels=torch.tensor([[1, 5, 7]])).loss.backward()
    with pytest.raises(ConfigError, match="already hold a gradient before dp.step\\(\\)"):
        dp.step()
    dp.optimizer.zero_grad(set_to_none=True)
    dp.step()  # cleared: it goes on


def test_a_model_moved_after_make_private_is_refused(ckpt):
    dp = _private(ckpt)
    dp.model.to("meta")  # any other device; this machine has no GPU
    with pytest.raises(ConfigError, match="moved to meta after make_private placed it on cpu.*opacus#820"):
        dp.step()


def test_changing_what_trains_after_make_private_is_refused(ckpt):
    dp = _private(ckpt)
    next(p for p in dp.model.parameters() if p.requires_grad).requires_grad_(False)
    with pytest.raises(ConfigError, match="trainable parameters changed after make_private"):
        dp.step()


def test_a_layer_without_a_handler_is_refused(ckpt):
    _, model, _ = _rows_and_model(ckpt, lora=False)
    model.transformer.extra = torch.nn.Conv1d(2, 2, 1)  # trainable, and no registered handler
    with pytest.raises(ConfigError, match=r"cannot compute per-unit gradient norms .*transformer\.extra\.weight"):
        _private(ckpt, model)


def test_a_step_past_the_plan_is_refused(ckpt):
    dp = _private(ckpt, steps=1)
    dp.step()
    with pytest.raises(PrivacyError, match="all 1 planned steps ran"):
        dp.step()


@pytest.mark.parametrize("kw,match", [
    ({"steps": None}, "steps is missing"),
    ({"method": None}, r"\['method'\] missing"),
    ({"privacy": "PA"}, r"given both as keywords and in privacy="),
    ({"options": "BAD_BATCH"}, r"TrainingOptions.physical_batch_size .*0 is less than the minimum of 1"),
    ({"clip_norm": -1.0}, r"PrivacyArguments.clip_norm .*-1.0"),
    ({"tokenizer": 3}, "tokenizer is a int"),
    ({"method": "dp-sgd"}, "method is 'dp-sgd'"),
])
def test_bad_arguments_are_refused_naming_them(ckpt, kw, match):
    if kw.get("privacy") == "PA":
        kw["privacy"] = userdp.PrivacyArguments(method="els", epsilon=4.0, compute=90)
    with pytest.raises((ConfigError, PrivacyError), match=match):
        if kw.get("options") == "BAD_BATCH":
            kw["options"] = userdp.TrainingOptions(physical_batch_size=0)
        _private(ckpt, **kw)


# ---------------------------------------------------------------- one engine


@pytest.mark.integration
def test_make_private_trains_what_fine_tune_trains(ckpt, tmp_path):
    """Same rows, target, seed and optimizer (Adam, the pipeline's) through both entry points: the same weights
    and the same ledger (one engine; fine_tune's runs are the pipeline's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = users_frame(40)
    common = dict(data=rows, user_column="author", text_column="body", method="uls", epsilon=2.0, compute=400,
                  steps=5, secret_seeds=False, seed=3)
    ran = userdp.fine_tune(model=str(ckpt), output_dir=str(tmp_path / "ft"), learning_rate=0.01, **common)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    dp = userdp.make_private(model, torch.optim.Adam(model.parameters(), lr=0.01),
                             tokenizer=AutoTokenizer.from_pretrained(str(ckpt)), **common)
    while dp.steps_done < dp.spec.steps:
        dp.step()
    dp.save(tmp_path / "mp")
    a = userdp.load_released(tmp_path / "ft").state_dict()
    b = userdp.load_released(tmp_path / "mp").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb = ran.ledger, userdp.read_ledger(tmp_path / "mp")
    differ = sorted(k for k in la if la[k] != lb.get(k))
    assert differ == ["optimizer"], differ  # "adam" vs "Adam (the caller's)"
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "ft" / "train_log.parquet"),
                                  pd.read_parquet(tmp_path / "mp" / "train_log.parquet"))


def test_data_as_a_pyarrow_table_or_a_datasets_dataset(ckpt):
    import datasets
    import pyarrow as pa

    rows, _, _ = _rows_and_model(ckpt)
    specs = [_private(ckpt, data=d, secret_seeds=False).spec
             for d in (rows, pa.Table.from_pandas(rows), datasets.Dataset.from_pandas(rows))]
    assert specs[0].without_timing() == specs[1].without_timing() == specs[2].without_timing()


def test_epsilon_grows_with_the_steps_taken_and_save_before_the_end_says_so(ckpt, tmp_path):
    dp = _private(ckpt, steps=3)
    assert dp.epsilon == 0.0
    dp.step()
    one = dp.epsilon
    assert 0 < one < dp.spec.epsilon_achieved
    dp.save(tmp_path / "early")
    ledger = userdp.read_ledger(tmp_path / "early")
    assert not ledger["complete"] and ledger["steps_completed"] == 1 and ledger["epsilon"] == one
    assert "stopped after 1 of 3 planned steps" in (tmp_path / "early" / "README.md").read_text()
    dp.step(), dp.step()
    assert dp.epsilon == pytest.approx(dp.spec.epsilon_achieved, rel=1e-9)


def test_a_spec_made_before_is_trained_as_planned(ckpt):
    rows, _, _ = _rows_and_model(ckpt)
    counts = rows["author"].value_counts().to_numpy()
    spec = userdp.plan("uls", 3.0, counts=counts, compute=40, steps=2)
    dp = _private(ckpt, spec=spec, method=None, epsilon=None, compute=None, steps=None)
    assert dp.spec == spec
    with pytest.raises(ConfigError, match="given with spec="):
        _private(ckpt, spec=spec, steps=None)
    # steps that disagree with the spec are refused (before the rows are tokenized); steps that agree are fine
    with pytest.raises(ConfigError, match="steps is 3 but the spec plans 2"):
        _private(ckpt, spec=spec, method=None, epsilon=None, compute=None, steps=3)
    assert _private(ckpt, spec=spec, method=None, epsilon=None, compute=None, steps=2).spec == spec


def test_the_non_private_reference_has_no_guarantee(ckpt):
    dp = _private(ckpt, epsilon=math.inf)
    dp.step()
    assert dp.epsilon == math.inf and dp.spec.noise_multiplier == 0


@pytest.mark.integration
@pytest.mark.parametrize("method", ["els", "uls"])
def test_replay_on_neighbouring_datasets_through_make_private(ckpt, method):
    """docs/method.md section 11, invariant 7, on the make_private path: on D and on D minus its largest user,
    with the same spec and seeds, every step samples the same other units, draws bitwise the same noise, and the
    clipped sums are at most k_t C (ELS: k_t of the user's units sampled) or C (ULS) apart (learning rate 0, so
    both runs see the same parameters at every step; float64, dropout off)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = users_frame(30, seed=4)
    victim = rows["author"].value_counts().idxmax()
    spec = userdp.plan(method, 4.0, counts=rows["author"].value_counts().to_numpy(), compute=200, steps=8,
                       group_size=3)
    clip = float(spec.clip_norm)

    def replay(data):
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, resid_pdrop=0.0,
                                                     embd_pdrop=0.0, attn_pdrop=0.0)
        seen = []
        dp = userdp.make_private(model, torch.optim.SGD(model.parameters(), lr=0.0), data=data,
                                 user_column="author", text_column="body",
                                 tokenizer=AutoTokenizer.from_pretrained(str(ckpt)), spec=spec,
                                 secret_seeds=False, observe=seen.append)
        pool = dp.pool
        while dp.steps_done < spec.steps:
            dp.step()
        out = []
        for o in seen:
            user = np.asarray(pool.example_user)[o.selection.rows]
            rank = o.selection.rows - np.asarray(pool.user_offsets)[user]
            ids = [pool.user_ids[u] for u in user]
            units = set(zip(ids, rank.tolist())) if method == "els" else set(ids)
            out.append((units, o.clipped_sum, o.noise))
        return out

    full, without = replay(rows), replay(rows[rows["author"] != victim])
    sampled_victim = 0
    for (units_d, sum_d, noise_d), (units_n, sum_n, noise_n) in zip(full, without):
        mine = {u for u in units_d if (u[0] if method == "els" else u) == victim}
        assert units_d - mine == units_n  # the others' draws do not depend on the victim
        assert all(torch.equal(a, b) for a, b in zip(noise_d, noise_n))
        gap = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(sum_d, sum_n)))
        bound = clip * (len(mine) if method == "els" else (1 if mine else 0))
        assert gap <= bound + 1e-9, (gap, bound)
        sampled_victim += bool(mine)
    assert sampled_victim > 0  # the check saw the victim's units at least once


@pytest.mark.integration
def test_fine_tune_takes_a_lora_config_as_it_is(ckpt, tmp_path):
    """A peft LoraConfig given to fine_tune trains the adapter the equivalent model.lora keys train."""
    from peft import LoraConfig

    common = dict(model=str(ckpt), data=users_frame(30), user_column="author", text_column="body", method="els",
                  epsilon=2.0, compute=90, steps=3, secret_seeds=False)
    a = userdp.fine_tune(output_dir=str(tmp_path / "keys"), lora={"r": 4, "alpha": 8}, **common)
    b = userdp.fine_tune(output_dir=str(tmp_path / "config"),
                         lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), **common)
    assert a.ledger["adapter"] == b.ledger["adapter"] and b.ledger["adapter"]["r"] == 4
    wa = userdp.load_released(tmp_path / "keys").state_dict()
    wb = userdp.load_released(tmp_path / "config").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ConfigError, match="lora is a str"):
        userdp.fine_tune(output_dir=str(tmp_path / "bad"), lora="r=4", **common)
