"""Token-level facts of a tokenizer that the framings share (`tokenize`'s text, `chat`'s conversations)."""

from __future__ import annotations

from ..errors import DataError


def backend(tok):
    """The Rust `tokenizers.Tokenizer` behind a transformers tokenizer (or `tok` itself)."""
    return tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok


def special_token_ids(tok) -> tuple[int, int]:
    """(bos, eos) token ids; a DataError when the tokenizer lacks one."""
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is None or eos is None:
        raise DataError("the tokenizer in results/tokenizer has no bos/eos token ids; rebuild it.")
    return int(bos), int(eos)
