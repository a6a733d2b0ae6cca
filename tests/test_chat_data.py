"""Chat and instruction data: framing with the tokenizer's chat template, the loss on the answers only.

The invariant (docs/method.md section 3, the unit's gradient): the per-example gradient that is clipped and
noised is the gradient of the masked loss, the mean cross-entropy over the assistant's tokens. It is checked
against a brute-force autograd of that loss, one example at a time, through the path training runs (tokens
table -> bounded pool -> micro-batch -> ClippedGradients); a label outside the answer may hold anything
without changing a gradient, a label inside it may not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import userdp
from train_fixtures import make_tokenizer
from userdp.data import chat
from userdp.errors import ConfigError, DataError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["user", "level", "privacy", "model", "token", "noise", "clip", "sample", "step", "data"]


def chat_checkpoint(folder: Path) -> Path:
    """A tiny GPT-2 and a BPE tokenizer with ChatML markers and template, saved together (as on the hub)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    make_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2, **ids)
                    ).save_pretrained(folder)
    return folder


def conversation(rng: np.random.Generator, turns: int = 1) -> list[dict[str, str]]:
    def say(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))
    msgs = [{"role": "system", "content": say(3)}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(3)}]
    return msgs


def chat_frame(n_users: int = 30, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        for _ in range(int(rng.integers(1, 5))):
            msgs = conversation(rng, int(rng.integers(1, 3)))
            rows.append({"author": f"a{u:03d}", "messages": msgs,
                         "prompt": msgs[1]["content"], "completion": msgs[2]["content"]})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def tok(ckpt):
    from userdp.api import _tokenizer

    return _tokenizer(str(ckpt))


# ---------------------------------------------------------------- framing


def test_the_chat_template_survives_the_project_tokenizer(tok):
    assert tok.chat_template == CHATML


def test_assistant_tokens_are_the_targets_and_nothing_else(tok):
    msgs = [{"role": "system", "content": "data model"}, {"role": "user", "content": "clip noise step"},
            {"role": "assistant", "content": "privacy token"}, {"role": "user", "content": "sample"},
            {"role": "assistant", "content": "level data"}]
    ids, lengths, mask, empty = chat.frame_examples(tok, "messages", [msgs], 64)
    assert empty == 0 and lengths.tolist() == [len(ids)]
    # the ids are the template's rendering, tokenized as the model sees it at inference
    assert ids.tolist() == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    targets = tok.decode(ids[mask])
    assert targets == "privacy token<|im_end|>\nlevel data<|im_end|>\n"
    context = tok.decode(ids[~mask])
    assert "clip noise step" in context and "data model" in context and "privacy" not in context
    assert context.count("<|im_start|>assistant\n") == 2  # the role headers are context


# A Qwen-like template (a default system prompt when the first message is not one), a Llama-like one (its own
# bos, header tokens written as text), a Mistral-like one that refuses roles out of turn, and one that shows
# only the last assistant answer (earlier turns are not prefixes of the whole).
QWEN_LIKE = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful model.<|im_end|>\n"
             "{% endif %}" + CHATML)
LLAMA_LIKE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] | trim }}{{ eos_token }}"
              "{% endfor %}{% if add_generation_prompt %}[assistant]: {% endif %}")
STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
          "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
LAST_ONLY = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
             "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")


def _with_template(tok, template):
    import copy as copy_module

    other = copy_module.deepcopy(tok)
    other.chat_template = template
    return other


def test_an_answer_first_conversation_keeps_the_default_system_prompt_as_context(tok):
    qwen = _with_template(tok, QWEN_LIKE)
    msgs = [{"role": "assistant", "content": "privacy token"}, {"role": "user", "content": "clip"},
            {"role": "assistant", "content": "noise"}]
    ids, _, mask, _ = chat.frame_examples(qwen, "messages", [msgs], 64)
    assert ids.tolist() == qwen.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert qwen.decode(ids[mask]) == "privacy token<|im_end|>\nnoise<|im_end|>\n"
    assert "You are a helpful model." in qwen.decode(ids[~mask])


def test_a_template_with_its_own_bos_and_trimmed_content(tok):
    llama = _with_template(tok, LLAMA_LIKE)
    msgs = [{"role": "user", "content": "clip noise"}, {"role": "assistant", "content": " privacy model "}]
    ids, _, mask, _ = chat.frame_examples(llama, "messages", [msgs], 64)
    assert ids[0] == tok.bos_token_id and not mask[0]
    assert llama.decode(ids[mask]) == "privacy model" + tok.eos_token
    assert "[assistant]:" in llama.decode(ids[~mask])


def test_a_template_that_refuses_or_reorders_is_a_data_error_naming_the_row(tok):
    from userdp.api import _rows, _tokens_table

    frame = pd.DataFrame({"author": ["a", "b"], "messages": [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "ok"}]]})
    users, examples = _rows(frame, "author", chat.Framing.of(messages_column="messages"))
    with pytest.raises(DataError, match=r"data row 1: the tokenizer's chat template refused this conversation "
                                        r"\(TemplateError: Conversation roles must alternate"):
        _tokens_table(_with_template(tok, STRICT), users, examples, 64, "messages")
    two_turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(DataError, match=r"row 0: the tokenizer's chat template does not render this "
                                        r"conversation's turns as prefixes"):
        chat.frame_examples(_with_template(tok, LAST_ONLY), "messages", [two_turns], 64)


def test_prompt_completion_targets_are_the_completion_and_eos(tok):
    ids, lengths, mask, _ = chat.frame_examples(tok, "prompt_completion", [("clip noise", " privacy model")], 64)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert ids[0] == bos and ids[-1] == eos and mask[-1] and not mask[0]
    assert tok.decode(ids[mask][:-1]) == " privacy model" and tok.decode(ids[~mask][1:]) == "clip noise"


def test_a_cut_answer_is_counted_and_trains_nothing(tok):
    rng = np.random.default_rng(1)
    long = [{"role": "user", "content": " ".join(rng.choice(WORDS, size=40))},
            {"role": "assistant", "content": "data"}]
    ids, lengths, mask, empty = chat.frame_examples(tok, "messages", [long], 16)
    assert lengths.tolist() == [16] and empty == 1 and not mask.any()


@pytest.mark.parametrize("kwargs,message", [
    ({"text_column": "t", "messages_column": "m"}, "give one kind of example"),
    ({"prompt_column": "p"}, "completion_column is not"),
    ({}, "no column of examples"),
    ({"messages_column": ""}, "messages_column is ''"),
])
def test_a_framing_names_its_columns_or_says_what_is_wrong(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        chat.Framing.of(**kwargs)


@pytest.mark.parametrize("value,message", [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ('[{"role": "assistant", "content": "hi"}]', "is a string, not a list of messages"),
    ([{"role": "assistant", "text": "hi"}], "message 0: .* is not a"),
    ([], "non-empty list"),
])
def test_bad_conversations_are_data_errors_naming_the_row(value, message):
    frame = pd.DataFrame({"author": ["a", "b"], "messages": [[{"role": "assistant", "content": "ok"}], value]})
    from userdp.api import _rows

    with pytest.raises(DataError, match=r"data row 1: column 'messages'.*" + message):
        _rows(frame, "author", chat.Framing.of(messages_column="messages"))


def test_a_tokenizer_without_chat_template_is_refused(tmp_path):
    from userdp.api import _tokenizer

    make_tokenizer(tmp_path / "plain")
    plain = _tokenizer(str(tmp_path / "plain"))
    with pytest.raises(ConfigError, match="has no chat template"):
        chat.frame_examples(plain, "messages", [[{"role": "assistant", "content": "x"}]], 16)


def test_stored_examples_round_trip_and_bad_text_is_named():
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "ok"}]
    assert chat.from_text("messages", chat.to_text("messages", msgs), "row 0") == msgs
    assert chat.from_text("prompt_completion", chat.to_text("prompt_completion", ("a", "b")), "row 0") == ("a", "b")
    with pytest.raises(DataError, match="row 3: the text is not a stored messages example"):
        chat.from_text("messages", "plain words", "row 3")


# ---------------------------------------------------------------- the per-example gradient


def _pool_batches(tok, frame: pd.DataFrame, kind: str):
    """The rows as training builds them: tokens table, bounded pool, one micro-batch with every example."""
    from userdp.api import _rows, _tokens_table
    from userdp.training.batching import pack_micro_batches, select_els
    from userdp.training.pool import build_pool

    framing = (chat.Framing.of(messages_column="messages") if kind == "messages"
               else chat.Framing.of(prompt_column="prompt", completion_column="completion"))
    users, examples = _rows(frame, "author", framing)
    pool = build_pool(_tokens_table(tok, users, examples, 48, kind), group_size=100, seed=0)
    assert pool.loss_mask_values is not None and len(pool.loss_mask_values) == len(pool.token_values)
    (mb,) = pack_micro_batches(pool, select_els(pool, np.arange(pool.n_examples)), pool.n_examples, 48,
                               tok.pad_token_id)
    return mb


def _brute_force(model, ids, mask, loss_mask, params):
    """Per example: the autograd gradient of the mean CE over its target tokens, token by token in float64
    (HF's own loss upcasts to float32 only)."""
    grads = []
    for r in range(ids.shape[0]):
        logits = model(input_ids=ids[r:r + 1], attention_mask=mask[r:r + 1]).logits[0]
        targets = [t for t in range(1, ids.shape[1]) if mask[r, t] and loss_mask[r, t]]
        loss = sum(-torch.log_softmax(logits[t - 1], -1)[ids[r, t]] for t in targets) / len(targets)
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(grads)


def _per_example(model, mb, params, labels=None):
    """Per example, the gradient ClippedGradients adds (no clipping bites at C = 1e9), one unit per call."""
    from userdp.training.clipping import ClippedGradients

    cg = ClippedGradients(model, 1e9)
    out = []
    for r in range(mb.n_rows):
        keep = torch.full_like(mb.unit_ids, -1)
        keep[r] = 0
        for p in params:
            p.grad = None
        cg.accumulate(mb.input_ids, mb.attention_mask, keep, mb.row_weights, mb.loss_mask, labels)
        out.append(torch.cat([p.grad.flatten() for p in params]))
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["messages", "prompt_completion"])
def test_the_per_example_gradient_is_the_masked_losss_and_ignores_labels_outside_the_answer(ckpt, tok, kind):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    mb = _pool_batches(tok, chat_frame(4, seed=2), kind)
    n = mb.n_rows
    ids, mask, lm = mb.input_ids[:n], mb.attention_mask[:n], mb.loss_mask[:n]
    assert lm.any(1).all() and (~lm & (mask == 1)).any(1).all()  # every row has answer and context tokens
    got = _per_example(model, mb, params)
    ref = _brute_force(model, ids, mask, lm, params)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    # the clipped norms are the masked gradients' norms
    from userdp.training.clipping import ClippedGradients

    norms = ClippedGradients(model, 1e-3).accumulate(mb.input_ids, mb.attention_mask, mb.unit_ids,
                                                     mb.row_weights, mb.loss_mask).unit_norms
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
    # a label outside the answer (a user or system token's) may hold anything: the gradients do not move
    labels = mb.input_ids.clone()
    outside = (~mb.loss_mask) & (mb.attention_mask == 1)
    outside[:, 0] = False
    labels[outside] = (labels[outside] + 7) % len(tok)
    torch.testing.assert_close(_per_example(model, mb, params, labels), got, rtol=0, atol=0)
    # ... while a label inside it changes its row's gradient (the check can fail)
    inside = mb.loss_mask.clone()
    inside[:, 0] = False
    labels = mb.input_ids.clone()
    labels[inside] = (labels[inside] + 7) % len(tok)
    moved = _per_example(model, mb, params, labels)
    assert all(not torch.allclose(moved[r], got[r]) for r in range(n))


def test_per_user_gradients_of_several_rows_are_the_masked_losses_weighted_mean(ckpt, tok):
    """ULS units of 1 to 4 rows (sorted by unit size inside ClippedGradients): each user's clipped norm is the
    norm of sum_r grad(masked loss of r) / m_u, brute force."""
    from transformers import AutoModelForCausalLM

    from userdp.api import _rows, _tokens_table
    from userdp.training.batching import pack_micro_batches, select_uls
    from userdp.training.clipping import ClippedGradients
    from userdp.training.pool import build_pool

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    rng = np.random.default_rng(5)
    frame = pd.DataFrame([{"author": f"u{u}", "messages": conversation(rng, 1 + r % 2)}
                          for u, size in enumerate([4, 1, 3, 2, 4]) for r in range(size)])
    users, examples = _rows(frame, "author", chat.Framing.of(messages_column="messages"))
    pool = build_pool(_tokens_table(tok, users, examples, 48, "messages"), group_size=4, seed=0)
    (mb,) = pack_micro_batches(pool, select_uls(pool, np.arange(pool.n_users)), 32, 48, tok.pad_token_id)
    assert sorted(np.bincount(mb.unit_ids[mb.unit_ids >= 0].numpy()).tolist()) == [1, 2, 3, 4, 4]
    norms = ClippedGradients(model, 1e-3).accumulate(mb.input_ids, mb.attention_mask, mb.unit_ids,
                                                     mb.row_weights, mb.loss_mask).unit_norms
    n = mb.n_rows
    per_row = _brute_force(model, mb.input_ids[:n], mb.attention_mask[:n], mb.loss_mask[:n], params)
    units, weights = mb.unit_ids[:n], mb.row_weights[:n].double()
    want = torch.stack([(per_row[units == u] * weights[units == u, None]).sum(0).norm()
                        for u in torch.unique(units)])
    torch.testing.assert_close(norms, want, rtol=1e-9, atol=1e-12)


def test_the_plain_text_loss_is_unchanged_by_the_mask_argument(ckpt, tok):
    """loss_mask None and an all-true mask are one loss: text rows train as before."""
    from userdp.training.clipping import row_losses

    torch.manual_seed(0)
    logits = torch.randn(3, 6, len(tok), dtype=torch.float64)
    ids = torch.randint(0, len(tok), (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    a, na = row_losses(logits, ids, mask)
    b, nb = row_losses(logits, ids, mask, torch.ones(3, 6, dtype=torch.bool))
    assert torch.equal(a, b) and torch.equal(na, nb)


# ---------------------------------------------------------------- the entry points


@pytest.mark.integration
def test_make_private_trains_chat_rows_and_the_ledger_is_the_guarantee(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = userdp.make_private(model, optimizer, data=chat_frame(), user_column="author", messages_column="messages",
                             tokenizer=AutoTokenizer.from_pretrained(ckpt), method="uls", epsilon=4.0,
                             compute=200, steps=4, secret_seeds=False)
    assert dp.pool.loss_mask_values is not None
    for _ in range(dp.spec.steps):
        stats = dp.step()
    assert math.isfinite(stats.loss) and dp.epsilon <= 4.0 + 1e-9
    dp.save(tmp_path / "out")
    ledger = userdp.read_ledger(tmp_path / "out")
    assert userdp.epsilon(ledger) == pytest.approx(dp.epsilon, rel=1e-12) and ledger["loss_tokens"] == "answers"
    assert "on the answer tokens only" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.integration
def test_fine_tune_and_evaluate_score_the_answers_only(ckpt, tmp_path):
    frame = chat_frame()
    run = userdp.fine_tune(model=str(ckpt), data=frame, user_column="author", prompt_column="prompt",
                           completion_column="completion", method="els", epsilon=4.0, compute=200, steps=3,
                           output_dir=tmp_path / "run", secret_seeds=False)
    assert run.epsilon <= 4.0 + 1e-9
    held = chat_frame(6, seed=9)
    result = userdp.evaluate(tmp_path / "run", data=held, user_column="author", messages_column="messages",
                             tokenizer=str(ckpt))
    from userdp.api import _tokenizer

    tok = _tokenizer(str(ckpt))
    _, lengths, mask, _ = chat.frame_examples(tok, "messages", [list(m) for m in held["messages"]], 64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    # the scored tokens are the answer tokens after each row's first token, nothing else
    assert result.metrics["n_tokens"] == int(sum(mask[s + 1:s + n].sum() for s, n in zip(starts, lengths)))
    assert result.metrics["n_tokens"] < int(lengths.sum()) - len(lengths)  # not every next token
    assert math.isfinite(result.loss)


# ---------------------------------------------------------------- the pipeline's data stage

FORMATS = ["parquet", "jsonl", "csv"]
EXT = {"parquet": ".parquet", "jsonl": ".jsonl", "csv": ".csv"}


def _local_chat(tmp_path, fmt: str, rows: list[dict], **spec):
    from builders import build_local
    from userdp.data.local import LocalSource

    if fmt == "csv":  # in CSV a conversation is its JSON text
        rows = [{k: json.dumps(v) if k == "messages" else v for k, v in r.items()} for r in rows]
    path = build_local(tmp_path / f"chats{EXT[fmt]}", fmt, rows)
    return LocalSource("mine", {"source": "local", "path": str(path), **spec}, tmp_path / "data")


def _chat_rows(n_users: int = 12, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"author": f"u{u:02d}", "messages": conversation(rng), "q": "clip noise", "a": " privacy"}
            for u in range(n_users) for _ in range(int(rng.integers(1, 4)))]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_local_source_reads_conversations_in_every_format(tmp_path, fmt):
    rows = _chat_rows()
    src = _local_chat(tmp_path, fmt, rows, user_column="author", messages_column="messages")
    got = [t for b in src.iter_batches(5) for t in b.column("text").to_pylist()]
    assert got == [chat.to_text("messages", r["messages"]) for r in rows]
    pairs = _local_chat(tmp_path, fmt, rows, user_column="author", prompt_column="q", completion_column="a")
    got = [t for b in pairs.iter_batches(5) for t in b.column("text").to_pylist()]
    assert got == [chat.to_text("prompt_completion", ("clip noise", " privacy"))] * len(rows)


@pytest.mark.parametrize("fmt,where", [("jsonl", "line 2"), ("parquet", "row 2"), ("csv", r"row 2 \(not counting the header\)")])
def test_a_conversation_without_an_answer_names_file_and_row(tmp_path, fmt, where):
    rows = _chat_rows(2)
    rows[1]["messages"] = [{"role": "user", "content": "hi"}]
    src = _local_chat(tmp_path, fmt, rows, user_column="author", messages_column="messages")
    with pytest.raises(DataError, match=rf"chats{EXT[fmt]} .*{where}, column 'messages'.*no assistant message"):
        list(src.iter_batches(5))


def test_a_csv_cell_that_is_not_json_is_named(tmp_path):
    from builders import build_local
    from userdp.data.local import LocalSource

    path = build_local(tmp_path / "c.csv", "csv", [{"author": "a", "messages": "hello there"}])
    src = LocalSource("mine", {"source": "local", "path": str(path), "user_column": "author",
                               "messages_column": "messages"}, tmp_path / "data")
    with pytest.raises(DataError, match=r"row 1 \(not counting the header\), column 'messages' is not JSON text"):
        list(src.iter_batches(5))


def test_two_kinds_of_example_in_a_dataset_spec_are_refused(tmp_path):
    from userdp.data.local import LocalSource

    with pytest.raises(ConfigError, match=r"datasets\.mine\.messages_column and datasets\.mine\.text_column"):
        LocalSource("mine", {"source": "local", "path": "x.jsonl", "text_column": "t", "messages_column": "m"},
                    tmp_path)


def test_prepare_and_tokenize_carry_the_framing_and_the_loss_mask(tmp_path, ckpt, tok):
    import pyarrow.parquet as pq

    from userdp.data.prepare import prepare_dataset
    from userdp.data.tokenize import load_named, tokenize_examples
    from userdp.training.pool import build_pool, load_train_pool, read_train_tokens

    spec = {"source": "local", "path": "", "user_column": "author", "messages_column": "messages",
            "split": {"validation": 0.2, "test": 0.2}}
    src = _local_chat(tmp_path, "jsonl", _chat_rows(20), **{k: v for k, v in spec.items() if k != "path"
                                                           and k != "source" and k != "split"})
    prepare_dataset(src, "mine", spec, tmp_path / "out", seed=0)
    examples = tmp_path / "out" / "examples.parquet"
    assert chat.Framing.of_examples(pq.read_schema(examples)) == "messages"
    load_named(str(ckpt), tmp_path / "tokenizer")
    tokens = tmp_path / "out" / "tokens.parquet"
    info = tokenize_examples(examples, tmp_path / "tokenizer", tokens, 48)
    assert info["framing"] == "messages"
    table = pq.read_table(tokens)
    texts = pq.read_table(examples).column("text").to_pylist()
    ids, lengths, mask, _ = chat.frame_examples(tok, "messages", [json.loads(t) for t in texts], 48)
    assert sum(table.column("loss_mask").to_pylist(), []) == mask.tolist()
    assert sum(table.column("input_ids").to_pylist(), []) == ids.tolist()
    streamed, whole = load_train_pool(tokens, 2, seed=3, batch_rows=7), build_pool(read_train_tokens(tokens), 2, 3)
    assert np.array_equal(streamed.loss_mask_values, whole.loss_mask_values)
    assert np.array_equal(streamed.token_values, whole.token_values) and streamed.loss_mask_values.any()
    # every pool row holds its own example's tokens and mask (a misordering shared by both routes fails here)
    by_id = {r["example_id"]: r for r in table.to_pylist()}
    for r in range(streamed.n_examples):
        row = by_id[int(streamed.example_ids[r])]
        assert streamed.tokens(r).tolist() == row["input_ids"] and streamed.loss_mask(r).tolist() == row["loss_mask"]
    with pytest.raises(ConfigError, match="long_examples is 'chunk'.*holds messages examples"):
        tokenize_examples(examples, tmp_path / "tokenizer", tmp_path / "x.parquet", 48, "chunk")
    make_tokenizer(tmp_path / "plain")
    load_named(str(tmp_path / "plain"), tmp_path / "plain-prepared")
    with pytest.raises(ConfigError, match="tokenizer.name, results/tokenizer.*no chat template"):
        tokenize_examples(examples, tmp_path / "plain-prepared", tmp_path / "y.parquet", 48)
    assert not (tmp_path / "y.parquet").exists() and not (tmp_path / "x.parquet").exists()
    # a bad row part-way through (after batches were written) leaves no half-written tokens table
    import pyarrow as pa

    bad = pq.read_table(examples)
    texts[11] = "not a conversation"
    pq.write_table(bad.set_column(bad.schema.get_field_index("text"), "text", pa.array(texts)).replace_schema_metadata(
        bad.schema.metadata), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet, row 12: the text is not a stored messages example"):
        tokenize_examples(tmp_path / "bad.parquet", tmp_path / "tokenizer", tmp_path / "z.parquet", 48, batch_rows=5)
    assert not (tmp_path / "z.parquet").exists() and not list(tmp_path.glob("*.tmp*"))
