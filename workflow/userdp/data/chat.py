"""Chat and instruction examples: what a row's tokens are and which of them carry the loss.

An example is framed in one of three ways (`Framing.kind`):

- `text`: bos + text + eos (cut to the sequence length); every token after
  bos is a target. The pipeline's framing (`tokenize.frame`).
- `messages`: a list of `{"role", "content"}` dicts, rendered by the
  tokenizer's chat template as the model sees a conversation (the
  template's own special tokens; no bos or eos is added). The targets are
  the tokens of the assistant messages as the template renders them (their
  content and the template's end-of-turn marker), found by rendering
  prefixes: assistant message i spans the characters from where the
  template puts its content (messages[:i] rendered with an assistant
  message whose content is a sentinel) to the end of
  render(messages[:i + 1]). System, user and tool tokens, the role headers
  and any default system prompt the template adds are context only.
- `prompt_completion`: bos + prompt + completion + eos, the prompt and the
  completion encoded separately (so the boundary is exact); the targets are
  the completion's tokens and eos.

A token is a target when its characters overlap an assistant span. The loss
of a row is the mean next-token cross-entropy over its targets
(`training.clipping.row_losses` with the row's `loss_mask`), so every
per-example and per-user gradient, and the clipping and noise on it, see the
answers only. A row whose targets were all cut by the sequence length keeps
a zero loss and a zero gradient (`frame_examples` counts such rows).

In the pipeline a chat or instruction example travels through examples.parquet
as the JSON text of its messages (or of {"prompt", "completion"}), written
by `to_text` and read back by `from_text`; the framing is recorded in the
file's schema metadata (`FRAMING_META`), so the tokenize stage frames it
with the tokenizer it has.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, DataError

log = logging.getLogger("userdp.data.chat")

KINDS = ("text", "messages", "prompt_completion")
FRAMING_META = "userdp_framing"  # examples.parquet schema metadata key: the examples' framing kind
LOSS_MASK = "loss_mask"          # tokens table column: per token, whether it is a target
#: Per framing kind, the settings that name its example columns (in the order of `Framing.columns`).
_KIND_KEYS = {"text": ("text_column",), "messages": ("messages_column",),
              "prompt_completion": ("prompt_column", "completion_column")}
#: The settings that name a table's example columns (make_private's keywords, PrivacyArguments' fields, the
#: local source's datasets.<name>.* keys).
COLUMN_KEYS = tuple(key for keys in _KIND_KEYS.values() for key in keys)


@dataclasses.dataclass(frozen=True)
class Framing:
    """How a table's rows become examples: the kind and the data's columns that hold them."""

    kind: str
    columns: tuple[str, ...]

    @classmethod
    def of(cls, *, text_column: str | None = None, messages_column: str | None = None,
           prompt_column: str | None = None, completion_column: str | None = None,
           owner: str = "", default_text: str | None = None) -> "Framing":
        """The framing the given column names ask for; exactly one kind. `owner` prefixes the names in errors;
        `default_text`: the text column when no column is given (None: that is an error)."""
        given = {k: v for k, v in zip(COLUMN_KEYS, (text_column, messages_column, prompt_column, completion_column))
                 if v is not None}
        if not given and default_text is not None:
            given = {"text_column": default_text}
        for key, value in given.items():
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{owner}{key} is {value!r}; give the column's name.")
        pair = [k for k in ("prompt_column", "completion_column") if k in given]
        if len(pair) == 1:
            other = ({"prompt_column", "completion_column"} - set(pair)).pop()
            raise ConfigError(f"{owner}{pair[0]} is set but {owner}{other} is not: instruction data needs both "
                              "(the loss is on the completion only).")
        kinds = [kind for kind, keys in _KIND_KEYS.items() if any(k in given for k in keys)]
        if len(kinds) > 1:
            raise ConfigError(f"{' and '.join(owner + k for k in sorted(given))} are set: give one kind of example, "
                              f"{owner}text_column (plain text), {owner}messages_column (chat, loss on the "
                              f"assistant's messages) or {owner}prompt_column with {owner}completion_column.")
        if not kinds:
            raise ConfigError(f"no column of examples is given: set {owner}text_column, {owner}messages_column or "
                              f"{owner}prompt_column with {owner}completion_column.")
        return cls(kinds[0], tuple(given[k] for k in _KIND_KEYS[kinds[0]]))

    @classmethod
    def of_spec(cls, name: str, spec: Mapping[str, Any]) -> "Framing":
        """The framing of dataset `name`'s rows (`datasets.<name>.text_column` / `messages_column` /
        `prompt_column` + `completion_column`; only the local source has them: text in "text" by default)."""
        keys = {k: spec.get(k) for k in COLUMN_KEYS}
        return cls.of(owner=f"datasets.{name}.", default_text="text", **keys)

    @classmethod
    def of_examples(cls, schema: Any) -> str:
        """The framing kind recorded in an examples.parquet schema (`FRAMING_META`), "text" when none is."""
        meta = schema.metadata or {}
        kind = meta.get(FRAMING_META.encode(), b"text").decode()
        if kind not in KINDS:
            raise DataError(f"examples.parquet records the framing {kind!r}, not one of {KINDS}; it was written by "
                            "another version. Delete it and rerun snakemake.")
        return kind

    @property
    def column_keys(self) -> tuple[str, ...]:
        """The names of the settings that hold `columns` (text_column, ... in the same order)."""
        return _KIND_KEYS[self.kind]


# ---------------------------------------------------------------- checking examples


def check_example(kind: str, values: Sequence[Any], where: str) -> Any:
    """One example of `kind` from its column values, checked (DataError naming `where`); the framed object."""
    if kind == "text":
        (text,) = values
        if not isinstance(text, str):
            raise DataError(f"{where} holds {text!r} ({type(text).__name__}), not text; store the texts as strings "
                            "and drop rows without one.")
        return text
    if kind == "messages":
        return check_messages(values[0], where)
    prompt, completion = values
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise DataError(f"{where}: the {name} is {value!r} ({type(value).__name__}), not text; a "
                            "prompt/completion pair is two strings (for conversations use a messages column).")
    if not completion:
        raise DataError(f"{where}: the completion is empty, so the row has nothing to learn; drop it.")
    return (prompt, completion)


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """A conversation as a list of {"role", "content"} string dicts with at least one assistant message."""
    if isinstance(value, str):
        raise DataError(f"{where} is a string, not a list of messages; give each row as a list of "
                        '{"role": ..., "content": ...} dicts (json.loads it first if it is JSON text).')
    if hasattr(value, "tolist") and not isinstance(value, Mapping):  # numpy arrays from pandas' Parquet reader
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where} is {_short(value)}; give a non-empty list of {{\"role\", \"content\"}} dicts.")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}, message {i}: {_short(msg)} is not a {{\"role\": str, \"content\": str}} "
                            "dict.")
        out.append({"role": msg["role"], "content": msg["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where} has no assistant message (roles: {sorted({m['role'] for m in out})}): the loss "
                        "is on the assistant's messages only, so the row has nothing to learn; drop it or fix "
                        "its roles.")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------- the pipeline's storage


def to_text(kind: str, example: Any) -> str:
    """The examples.parquet `text` of a checked chat or instruction example (canonical JSON)."""
    if kind == "messages":
        return json.dumps(example, ensure_ascii=False, separators=(",", ":"))
    prompt, completion = example
    return json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False, separators=(",", ":"))


def from_text(kind: str, text: str, where: str) -> Any:
    """The example that `to_text` stored (a DataError naming `where` when the text is not such JSON)."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if kind == "messages" and isinstance(value, list):
        return check_messages(value, where)
    if kind == "prompt_completion" and isinstance(value, dict) and set(value) == {"prompt", "completion"}:
        return check_example(kind, (value["prompt"], value["completion"]), where)
    raise DataError(f"{where}: the text is not a stored {kind} example ({_short(text)}); examples.parquet was "
                    "written by another version or edited. Delete it and rerun snakemake.")


# ---------------------------------------------------------------- framing


def loss_masks(table: Any) -> list[np.ndarray] | None:
    """Each row's loss mask of a tokens table (chat and instruction data), or None (text: every token)."""
    if LOSS_MASK not in table.column_names:
        return None
    return [np.asarray(x, dtype=bool) for x in table.column(LOSS_MASK).to_pylist()]


def warn_cut_answers(empty: int, total: int, sequence_length: int) -> None:
    """Log how many rows lost every answer token to the sequence length (they train nothing)."""
    if empty:
        log.warning("%d of %d rows have no answer token within the first %d tokens (the sequence length): they "
                    "train nothing; raise the sequence length or shorten the prompts", empty, total,
                    sequence_length)


def chat_template_of(tok: Any, owner: str = "the tokenizer") -> None:
    """Raise a ConfigError when `tok` has no chat template to frame messages with."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{owner} has no chat template, so chat messages cannot be framed as the model sees "
                          "them. Use the chat model's own tokenizer (its tokenizer_config.json or "
                          "chat_template.jinja holds the template), set tok.chat_template, or give the data as "
                          "prompt/completion columns.")


#: Stands in for an assistant message's content to find where the template puts that content.
_SENTINEL = "\u2063userdp-answer\u2063"


def render_messages(tok: Any, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the chat template renders it, and the character spans of its assistant messages.

    Assistant message i spans from where the template puts its content (found by rendering messages[:i] plus
    an assistant message whose content is a sentinel: the role header and whatever the template adds before
    an answer, a default system prompt included, stay context) to the end of render(messages[:i + 1]) (its
    content and end-of-turn marker). Every such rendering must be a prefix of the whole conversation's.
    """
    def render(msgs: list[dict[str, str]]) -> str:
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        except Exception as exc:  # jinja2's TemplateError and the template's own raise_exception(...)
            raise DataError(f"{where}: the tokenizer's chat template refused this conversation "
                            f"({type(exc).__name__}: {exc}); fix the row's roles or order, or give "
                            "prompt/completion columns.") from None

    full = render(messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        probe = render([*messages[:i], {"role": "assistant", "content": _SENTINEL}])
        upto = render(messages[:i + 1])
        at = probe.find(_SENTINEL)
        start_text = probe[:at]
        if at < 0 or not (upto.startswith(start_text) and full.startswith(upto)):
            raise DataError(f"{where}: the tokenizer's chat template does not render this conversation's turns "
                            f"as prefixes of one another (message {i}, an assistant message), so its assistant "
                            "tokens cannot be found (templates that drop earlier reasoning or reorder turns do "
                            "this). Give one assistant answer per row (the last message), or prompt/completion "
                            "columns.")
        spans.append((len(start_text), len(upto)))
    return full, spans


def _span_mask(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    starts = np.fromiter((o[0] for o in offsets), np.int64, len(offsets))
    ends = np.fromiter((o[1] for o in offsets), np.int64, len(offsets))
    mask = np.zeros(len(offsets), bool)
    for s, e in spans:
        mask |= (starts < e) & (ends > s)
    return mask


def frame_examples(tok: Any, kind: str, examples: Sequence[Any], sequence_length: int, *,
                   where: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(flat int32 ids, lengths, flat bool loss mask, rows without a target) of checked chat/instruction examples.

    Every row is cut to `sequence_length` tokens. `where` names each row in errors.
    """
    from .token_ids import backend as _backend
    from .token_ids import special_token_ids

    if kind not in ("messages", "prompt_completion"):
        raise ValueError(f"frame_examples frames chat or instruction examples, not {kind!r}")
    backend = _backend(tok)
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    if kind == "messages":
        chat_template_of(tok)
        rendered = [render_messages(tok, m, where[i] if where else f"row {i}") for i, m in enumerate(examples)]
        encs = backend.encode_batch([r[0] for r in rendered], add_special_tokens=False)
        for enc, (_, spans) in zip(encs, rendered):
            ids_parts.append(np.asarray(enc.ids, np.int32))
            mask_parts.append(_span_mask(enc.offsets, spans))
    else:
        bos, eos = special_token_ids(tok)
        prompts = backend.encode_batch_fast([p for p, _ in examples], add_special_tokens=False)
        completions = backend.encode_batch_fast([c for _, c in examples], add_special_tokens=False)
        for p, c in zip(prompts, completions):
            ids_parts.append(np.asarray([bos, *p.ids, *c.ids, eos], np.int32))
            mask_parts.append(np.concatenate([np.zeros(1 + len(p.ids), bool), np.ones(len(c.ids) + 1, bool)]))
    ids_parts = [x[:sequence_length] for x in ids_parts]
    mask_parts = [m[:sequence_length] for m in mask_parts]
    # position 0 is never predicted: a row needs a target after its first token
    empty = sum(1 for m in mask_parts if not m[1:].any())
    lengths = np.fromiter((len(x) for x in ids_parts), np.int64, len(ids_parts))
    flat = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
    mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, bool)
    return flat.astype(np.int32), lengths, mask, empty
