"""Prompts refused from their size before they are tokenized: work before validation is bounded by the
limits (max_model_len), not by the body.

A prompt fits when it has fewer than max_model_len tokens. Where the tokenizer has a sound bound on the
bytes one token stands for (`Tokenizer.max_bytes_per_token`, M), a text of more than (max_model_len - 1) * M
characters (each at least one byte) has at least max_model_len tokens: it is refused without calling the
tokenizer. Otherwise only a bounded prefix is tokenized (`PREFIX_CHARS_PER_TOKEN` characters per allowed
token, in a worker thread): a prefix that already has more than max_model_len tokens refuses the prompt.
"""
from __future__ import annotations

import asyncio

from serve.errors import APIError

PREFIX_CHARS_PER_TOKEN = 16  # the prefix tokenized where the tokenizer has no sound bound


def _refusal(param: str, chars: int, limit: int, bound: str) -> APIError:
    return APIError(400, f"{param} is {chars} characters: it has at least {limit} tokens ({bound}); "
                         f"max_model_len is {limit} (a prompt must leave room for at least one generated token)",
                    param=param, code="context_length_exceeded")


def refused_unseen(tokenizer, text: str, max_model_len: int, param: str) -> bool | None:
    """Raise a 400 if `text` is too long for max_model_len from its length alone (no tokenizer call);
    True if it certainly fits that test, None if only a prefix's tokens can tell (see `check_prefix`)."""
    m = getattr(tokenizer, "max_bytes_per_token", None)
    if m is not None:
        if len(text) > (max_model_len - 1) * m:
            raise _refusal(param, len(text), max_model_len, f"no token stands for more than {m} bytes")
        return True
    return None if len(text) > max_model_len * PREFIX_CHARS_PER_TOKEN else True


def check_prefix(tokenizer, text: str, max_model_len: int, param: str) -> None:
    """Tokenize a bounded prefix of `text` (call in a worker thread); raise a 400 if it alone has more than
    max_model_len tokens (one spare for a piece the cut may have split)."""
    n = len(tokenizer.encode(text[:max_model_len * PREFIX_CHARS_PER_TOKEN], add_special_tokens=False))
    if n > max_model_len:
        raise _refusal(param, len(text), max_model_len, f"its first {max_model_len * PREFIX_CHARS_PER_TOKEN} "
                       f"characters have {n}")


async def check_prompts(tokenizer, texts: list[str], max_model_len: int, param: str = "prompt") -> None:
    """Refuse (400) any text of `texts` too long for max_model_len, before the whole is tokenized; the
    event loop never tokenizes (a prefix, where needed, is tokenized in a worker thread)."""
    if tokenizer is None:
        return
    for text in texts:
        if refused_unseen(tokenizer, text, max_model_len, param) is None:
            await asyncio.to_thread(check_prefix, tokenizer, text, max_model_len, param)
