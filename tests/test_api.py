"""The public API (docs/api.md): the issue's snippet as written, on a tiny local checkpoint, ELS and ULS, LoRA and
full fine-tuning; the released guarantee re-accounted from the ledger's event; bad input refused with the project's
errors and nothing written; `userdp.__all__` equals the names docs/api.md lists.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import userdp
from train_fixtures import make_tokenizer
from userdp.errors import ConfigError, DataError, PrivacyError

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["user", "level", "privacy", "model", "token", "noise", "clip", "sample", "step", "data"]


def checkpoint(folder: Path) -> Path:
    """A tiny GPT-2 saved with save_pretrained, with its tokenizer in the same folder (as on the hub)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = make_tokenizer(folder)
    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def users_frame(n_users: int = 60, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        for _ in range(int(rng.integers(1, 7))):
            rows.append({"author": f"a{u:03d}", "body": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    checkpoint(root / "ckpt")
    users_frame().to_parquet(root / "my_users.parquet")
    return root


def snippet(model: str, lora: str, method: str) -> str:
    """The issue's acceptance snippet (docs/api.md), with the model path, method and LoRA setting filled in."""
    return textwrap.dedent(f"""\
        import pandas as pd, userdp
        rows = pd.read_parquet("my_users.parquet")            # columns: author, body
        run = userdp.fine_tune(
            model="{model}", data=rows, user_column="author", text_column="body",
            method="{method}", epsilon=4.0, compute=2000, steps=20, lora={lora}, output_dir="out/{method}-eps4")
        print(run.epsilon, run.delta, run.method, run.group_size, run.noise_multiplier)
        model = userdp.load_released("out/{method}-eps4")          # the released model, adapter merged
        """)


def test_the_snippet_is_the_one_in_docs():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    code = snippet("path/to/local-hf-checkpoint", '{"r": 8}', "uls")
    for line in code.splitlines():
        assert line.strip() in text, f"docs/api.md lacks the snippet line {line!r}"


@pytest.mark.integration
@pytest.mark.parametrize("method,lora", [("uls", '{"r": 8}'), ("els", "None"), ("els", '{"r": 8}'),
                                         ("uls", "None")])
def test_the_snippet_runs_and_its_epsilon_is_the_released_guarantee(workdir, monkeypatch, capsys, method, lora):
    monkeypatch.chdir(workdir)
    scope: dict = {}
    exec(compile(snippet(str(workdir / "ckpt"), lora, method), "snippet", "exec"), scope)
    run, model = scope["run"], scope["model"]
    printed = capsys.readouterr().out.split()
    assert printed[2] == method and float(printed[0]) == run.epsilon and int(printed[3]) == run.group_size
    out = workdir / "out" / f"{method}-eps4"
    ledger = userdp.read_ledger(out)
    # the released guarantee: <= the target, equal to the ledger's event re-accounted by the PLD accountant
    assert run.epsilon <= 4.0 + 1e-9 and run.epsilon == ledger["epsilon"]
    assert userdp.epsilon(ledger) == pytest.approx(run.epsilon, rel=1e-9)
    assert userdp.epsilon(run.spec) == pytest.approx(run.epsilon, rel=1e-9)
    assert ledger["complete"] and ledger["steps_completed"] == 20 and ledger["seeds_mode"] == "secret"
    # method.md section 10 on the API path: the sampling the plan accounted for is the one that ran (its rate,
    # the divisor q N = the planned expected batch, invariant 2), no user over G in the pool (invariant 3: the
    # pool is N_G = sum_u min(n_u, G)), the ledger's epsilon is the plan's (invariant 6), no secret state left
    spec = run.spec
    assert ledger["sampling_rate"] == spec.sampling_rate and ledger["group_size"] == spec.group_size
    assert ledger["expected_batch"] == pytest.approx(spec.expected_batch, rel=1e-9)
    counts = pd.read_parquet("my_users.parquet")["author"].value_counts().to_numpy()
    assert ledger["n_pool_examples"] == int(np.minimum(counts, spec.group_size).sum())
    assert run.epsilon == pytest.approx(spec.epsilon_achieved, rel=1e-9)
    assert not (workdir / "out" / f"{method}-eps4" / "checkpoint").exists()
    assert run.delta == pytest.approx(1 / 60 ** 1.1) and run.noise_multiplier > 0
    spec = userdp.RunSpec.load(out / "plan.json")
    assert spec == run.spec and spec.method == method and spec.group_size == run.group_size
    # the same run folder as the pipeline's: ledger, train log, model (or adapter)
    assert (out / "ledger.json").exists() and (out / "train_log.parquet").exists()
    adapter = (out / "model" / "adapter_config.json").exists()
    assert adapter == (lora != "None") and (ledger["adapter"] is not None) == adapter
    # the released model is a plain transformers model (adapter merged) that runs
    assert not hasattr(model, "peft_config")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 7]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()


@pytest.mark.integration
def test_a_finished_run_is_restored_not_retrained(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    rows = pd.read_parquet("my_users.parquet")
    kw = dict(model=str(workdir / "ckpt"), data=rows, user_column="author", text_column="body", method="els",
              epsilon=2.0, compute=600, steps=6, output_dir="out/again", secret_seeds=False)
    first = userdp.fine_tune(**kw)
    weights = (workdir / "out/again/model/model.safetensors").read_bytes()
    second = userdp.fine_tune(**kw)
    assert second.ledger == first.ledger
    assert (workdir / "out/again/model/model.safetensors").read_bytes() == weights
    assert first.ledger["seeds_mode"] == "derived" and first.ledger["guarantee_caveat"]


@pytest.mark.integration
def test_the_planner_is_the_pipelines(workdir):
    """userdp.plan = the pipeline's plan_cell on the same counts and defaults (the plan rule's script calls it)."""
    from userdp.config import run_config
    from userdp.privacy.planner import plan_cell
    from userdp.privacy.selection import Selection

    counts = np.array([1, 2, 2, 3, 5, 8, 13] * 20)
    spec = userdp.plan("uls", 4.0, counts=counts, compute=1000, steps=10)
    same = plan_cell(dataset="data", method="uls", epsilon=4.0, compute_budget=1000, steps=10, counts=counts,
                     privacy=run_config()["privacy"], selection=Selection("composed", 1))
    assert spec.without_timing() == same.without_timing()
    assert spec.epsilon_achieved <= 4.0 and spec.delta == pytest.approx(1 / counts.size ** 1.1)
    assert userdp.epsilon(spec) == pytest.approx(spec.epsilon_achieved, rel=1e-9)
    # the same accountant behind dp-accounting's interface (docs/api.md): one run's event, then a release more
    import dp_accounting

    acc = userdp.UserLevelAccountant().compose(spec.event)
    assert acc.get_epsilon(spec.delta) == userdp.epsilon(spec, per_run=True)
    assert acc.compose(dp_accounting.LaplaceDpEvent(20.0)).get_epsilon(spec.delta) > userdp.epsilon(spec, per_run=True)


@pytest.mark.parametrize("change,error,match", [
    ({"user_column": "user"}, DataError, r"no column\(s\) \['user'\]"),
    ({"epsilon": 0}, PrivacyError, "epsilon is 0"),
    ({"epsilon": -1.0}, PrivacyError, "epsilon > 0"),
    ({"method": "dp-sgd"}, ConfigError, "method is 'dp-sgd'"),
    ({"compute": 0}, ConfigError, "compute is 0"),
    ({"model": "NOWEIGHTS"}, ConfigError, "model.name"),
    ({"lora": {"rank": 8}}, ConfigError, "model.lora"),
    ({"privacy": {"clip_norm": -1}}, ConfigError, "privacy.clip_norm"),
    ({"data": "rows.parquet"}, DataError, "DataFrame"),
    ({"group_size": 0}, ConfigError, "group_size is 0"),
    ({"group_size": 2.5}, ConfigError, "group_size is 2.5"),
    pytest.param({"group_size": 1000}, ConfigError, "physical_batch_size", marks=pytest.mark.integration),  # ~2.5 s
    pytest.param({"lora": {"target_modules": ["q_proj"]}}, ConfigError, "c_attn", marks=pytest.mark.integration),
    pytest.param({"sequence_length": 512}, ConfigError, "at most 64", marks=pytest.mark.integration),
    ({"training": {"learning_rates": [0.1, 0.01]}}, ConfigError, "trains one run"),
    ({"secret_seeds": True, "privacy": {"secret_seeds": False}}, ConfigError, "give one of them"),
    ({"data": "MIXED_IDS"}, DataError, "mixes integer and string"),
    ({"data": "BOOL_IDS"}, DataError, "is a bool"),
    ({"data": "BLANK_USER"}, DataError, "row 1 has no user id"),
    ({"data": "NUMBER_TEXT"}, DataError, "not text"),
])
def test_bad_input_is_refused_and_nothing_is_written(workdir, tmp_path, change, error, match):
    rows = users_frame(20)
    kw = dict(model=str(workdir / "ckpt"), data=rows, user_column="author", text_column="body", method="uls",
              epsilon=4.0, compute=200, steps=4, output_dir=str(tmp_path / "out"))
    kw.update(change)
    if kw["model"] == "NOWEIGHTS":
        empty = tmp_path / "no-weights"
        empty.mkdir()
        (empty / "config.json").write_text((workdir / "ckpt" / "config.json").read_text())
        kw["model"] = str(empty)
    if isinstance(kw["data"], str) and kw["data"] == "BLANK_USER":
        kw["data"] = rows.assign(author=["a"] + [""] + list(rows["author"][2:]))
    if isinstance(kw["data"], str) and kw["data"] == "NUMBER_TEXT":
        kw["data"] = rows.assign(body=[1.5] * len(rows))
    if isinstance(kw["data"], str) and kw["data"] == "MIXED_IDS":
        kw["data"] = rows.assign(author=[7] + ["7"] * (len(rows) - 1))
    if isinstance(kw["data"], str) and kw["data"] == "BOOL_IDS":
        kw["data"] = rows.assign(author=[True] * len(rows))
    with pytest.raises(error, match=match):
        userdp.fine_tune(**kw)
    assert not (tmp_path / "out").exists()


def test_a_pyarrow_table_is_read_like_a_dataframe(workdir):
    import pyarrow as pa

    from userdp.api import _rows
    from userdp.data.chat import Framing

    table = pa.Table.from_pandas(users_frame(5))
    body = Framing.of(text_column="body")
    assert _rows(table, "author", body) == _rows(users_frame(5), "author", body)
    with pytest.raises(DataError, match=r"its columns are \['author', 'body'\]"):
        _rows(table, "user", body)


def test_all_matches_the_names_docs_api_lists():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)`", text, flags=re.M))
    assert listed == set(userdp.__all__), (sorted(listed ^ set(userdp.__all__)))
    for name in userdp.__all__:
        assert getattr(userdp, name) is not None
    with pytest.raises(AttributeError):
        userdp.no_such_name


@pytest.mark.integration
def test_plan_refuses_bad_counts_and_epsilon_of_a_spec_is_the_released_guarantee():
    for bad in ([3, 0, 2], [[1, 2], [3, 4]], [2.7, 3.0], []):
        with pytest.raises(DataError, match="counts must be"):
            userdp.plan("els", 2.0, counts=bad, compute=100, steps=5)
    counts = [3] * 200
    three = userdp.plan("els", 2.0, counts=counts, compute=600, steps=10, learning_rates=3)
    assert three.epsilon_target_of == "released model"
    assert userdp.epsilon(three) == pytest.approx(three.epsilon_achieved, rel=1e-6) and userdp.epsilon(three) <= 2.0
    assert userdp.epsilon(three, per_run=True) == pytest.approx(three.epsilon_per_run, rel=1e-6)
    assert userdp.epsilon(three, per_run=True) < 0.8 * userdp.epsilon(three)


@pytest.mark.integration
def test_a_lora_run_loads_from_another_folder(workdir, tmp_path, monkeypatch):
    """A relative model path is recorded absolute (the adapter names its base), so the released model loads
    from anywhere."""
    monkeypatch.chdir(workdir)
    run = userdp.fine_tune(model="ckpt", data=users_frame(20), user_column="author", text_column="body",
                           method="els", epsilon=8.0, compute=60, steps=3, lora={"r": 2}, output_dir="out/rel")
    assert run.output_dir.is_absolute()
    monkeypatch.chdir(tmp_path)
    model, ledger = userdp.load_released(run.output_dir, with_ledger=True)
    assert ledger["adapter"]["base_model"] == str(workdir / "ckpt") and not hasattr(model, "peft_config")


@pytest.mark.integration
def test_a_damaged_plan_is_a_clear_error(tmp_path):
    from userdp.io import write_json

    spec = userdp.plan("els", 2.0, counts=[3] * 50, compute=300, steps=5)
    good = spec.to_record()
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "noise_multiplier"}, r"\['noise_multiplier'\] missing"),
        "mistyped": (dict(good, steps="5"), "'steps' is '5', not a int"),
        "unknown": (dict(good, sigma=1.0), r"unknown plan field\(s\) \['sigma'\]"),
        "edited": (dict(good, sampling_rate=good["sampling_rate"] * 2), "edited after calibration"),
        "event removed": ({k: v for k, v in good.items() if k != "dp_event"}, r"\['dp_event'\] missing"),
        "null field": (dict(good, sampling_rate=None), r"\['sampling_rate'\] are null"),
        "noise dropped": (dict(good, noise_multiplier=0.0, dp_event={"module_name": "dp_accounting.dp_event",
                                                                      "class_name": "NonPrivateDpEvent"}),
                          "a private target needs noise"),
        "release removed": (dict(good, planning_sizes="DP histogram"), "contribution_stats is absent"),
        "no clip": (dict(good, clip_norm=None), "clip_norm is null"),
        "method": (dict(good, method="dpsgd"), "method is 'dpsgd'"),
    }
    for name, (record, match) in cases.items():
        path = tmp_path / f"{name}.json"
        write_json(path, record)
        with pytest.raises(DataError, match=match) as exc:
            userdp.RunSpec.load(path)
        assert str(path) in str(exc.value), name
    write_json(tmp_path / "good.json", good)
    assert userdp.RunSpec.load(tmp_path / "good.json") == spec
    assert math.isfinite(spec.noise_multiplier)


@pytest.mark.integration  # a fresh interpreter: ~1.5 s
def test_import_userdp_stays_light():
    """The public names load on first use: `import userdp` (the Snakefile's) and the RunSpec pull in no torch;
    nor does the group analysis, which only reads per-user scores."""
    import subprocess
    import sys

    code = ("import sys, userdp; userdp.RunSpec; userdp.plan; import userdp.evaluation.groups; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _reference_scores(ckpt: Path, frame: pd.DataFrame) -> pd.DataFrame:
    """Per-row NLL and targets computed with transformers alone: bos + text + eos, the model's own loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    rows = []
    for user, text in zip(frame["author"], frame["body"]):
        ids = torch.tensor([[bos, *tok(text)["input_ids"], tok.eos_token_id]])
        with torch.no_grad():
            mean = float(model(input_ids=ids, labels=ids).loss)
        rows.append({"user_id": user, "nll": mean * (ids.shape[1] - 1), "n_tokens": ids.shape[1] - 1})
    return pd.DataFrame(rows)


def test_evaluate_scores_held_out_users_as_transformers_does(workdir):
    held_out = users_frame(12, seed=7)
    result = userdp.evaluate(workdir / "ckpt", data=held_out, user_column="author", text_column="body",
                             batch_size=5)
    ref = _reference_scores(workdir / "ckpt", held_out)
    per_user = ref.groupby("user_id").sum()
    assert list(result.users.columns) == ["user_id", "nll", "n_tokens", "n_examples", "loss"]
    assert result.users["user_id"].tolist() == sorted(held_out["author"].unique())
    users = result.users.set_index("user_id")
    np.testing.assert_allclose(users["nll"], per_user["nll"], rtol=1e-5)
    assert users["n_tokens"].tolist() == per_user["n_tokens"].tolist()
    assert users["n_examples"].tolist() == held_out["author"].value_counts().sort_index().tolist()
    assert result.loss == pytest.approx(ref["nll"].sum() / ref["n_tokens"].sum(), rel=1e-5)
    assert result.loss_user_macro == pytest.approx((per_user["nll"] / per_user["n_tokens"]).mean(), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.loss))
    assert 0.0 <= result.accuracy <= 1.0 and result.metrics["n_users"] == 12
    assert result.metrics["n_examples"] == len(held_out)


@pytest.mark.parametrize("change, error, match", [
    ({"text_column": "text"}, DataError, r"no column\(s\) \['text'\]"),
    ({"batch_size": 0}, ConfigError, "batch_size is 0"),
    ({"batch_size": 2.5}, ConfigError, "batch_size is 2.5"),
    ({"device": "gpu"}, ConfigError, "device is 'gpu'"),
    ({"sequence_length": 0}, ConfigError, "sequence_length"),
    ({"sequence_length": 65}, ConfigError, "sequence_length is 65 but model .* has 64 positions"),
    ({"model": "no/such/folder"}, DataError, "no released model"),
])
def test_evaluate_refuses_bad_input(workdir, change, error, match):
    kw = dict(model=workdir / "ckpt", data=users_frame(3), user_column="author", text_column="body")
    with pytest.raises(error, match=match):
        userdp.evaluate(**{**kw, **change})


@pytest.mark.integration
def test_evaluate_a_released_run_folder(workdir, monkeypatch):
    """A LoRA run folder finds its tokenizer through the adapter's base model; a fully fine-tuned one has none
    and asks for tokenizer=; both score the released model (fine-tuning moved the loss)."""
    monkeypatch.chdir(workdir)
    rows, held_out = users_frame(), users_frame(10, seed=3)
    kw = dict(model=str(workdir / "ckpt"), data=rows, user_column="author", text_column="body", method="els",
              epsilon=8.0, compute=400, steps=4, secret_seeds=False, learning_rate=0.5)
    before = userdp.evaluate(workdir / "ckpt", data=held_out, user_column="author", text_column="body")
    lora = userdp.fine_tune(**kw, lora={"r": 4}, output_dir="out/eval-lora")
    full = userdp.fine_tune(**kw, output_dir="out/eval-full")
    on_lora = userdp.evaluate(lora.output_dir, data=held_out, user_column="author", text_column="body")
    assert on_lora.loss != before.loss and math.isfinite(on_lora.loss)
    with pytest.raises(ConfigError, match="holds no tokenizer.*pass tokenizer="):
        userdp.evaluate(full.output_dir, data=held_out, user_column="author", text_column="body")
    on_full = userdp.evaluate(full.output_dir, data=held_out, user_column="author", text_column="body",
                              tokenizer=workdir / "ckpt")
    assert on_full.loss != before.loss and len(on_full.users) == 10
