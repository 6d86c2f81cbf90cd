"""Completions prompts made token ids before they reach the engine: texts refused from their size
(serve/prompt_size.py), then tokenized in a worker thread, never on the event loop or the engine thread;
then `truncate_prompt_tokens` (vLLM's) applied to texts and token-id prompts alike; prompt_embeds decoded in
a worker thread too (and truncated alike)."""
from __future__ import annotations

import asyncio

from jaxpaged.core.validation import InvalidParam, check_text
from serve import prompt_embeds, prompt_size
from serve.errors import APIError


def truncation(req, max_model_len: int, max_tokens: int | None) -> tuple[int | None, str]:
    """(tokens to keep or None, side) of a request's truncate_prompt_tokens / truncation_side: -1 keeps as many
    as leave room for max_tokens (null: for one token); more than max_model_len is a 400."""
    n = req.truncate_prompt_tokens
    if n is None:
        return None, "left"
    if n == -1:
        n = max_model_len - max(max_tokens or 1, 1)
    if n > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({n}) is greater than max_model_len ({max_model_len})",
                       param="truncate_prompt_tokens")
    return max(n, 0), req.truncation_side or "left"


def truncate(ids: list[int], keep: int | None, side: str) -> list[int]:
    """The prompt's last `keep` tokens (side left) or first (side right); all of them when keep is None."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[len(ids) - keep:] if side == "left" else ids[:keep]


def _encode(tokenizer, text: str, check_size: bool, max_model_len: int) -> list[int]:
    """A prompt text's token ids (call in a worker thread); with `check_size`, a prefix first where the length
    alone cannot tell that it fits."""
    try:
        check_text("prompt", text)
    except InvalidParam as e:
        raise APIError(400, str(e), param="prompt") from None
    if check_size and prompt_size.refused_unseen(tokenizer, text, max_model_len, "prompt") is None:
        prompt_size.check_prefix(tokenizer, text, max_model_len, "prompt")
    return tokenizer.encode(text)


def _embeds(text: str, keep: int | None, side: str) -> dict:
    """One prompt_embeds string -> the engine prompt {'prompt_embeds': array} (call in a worker thread)."""
    try:
        a = prompt_embeds.decode(text)
    except prompt_embeds.BadTensor as e:
        raise APIError(400, f"prompt_embeds: {e}", param="prompt_embeds", code="invalid_prompt_embeds") from None
    if keep is not None and a.ndim == 2 and len(a) > keep:  # truncate_prompt_tokens cuts positions alike
        a = a[len(a) - keep:] if side == "left" else a[:keep]
    return {"prompt_embeds": a}


async def embeds_prompts(engine, texts: list[str], keep: int | None, side: str) -> list[dict]:
    """The engine prompts of a completions request's prompt_embeds (base64 torch.save'd tensors, decoded in a
    worker thread without torch: serve/prompt_embeds.py); the engine checks shape, dtype and length."""
    if not texts:
        return []
    if not engine.accepts_prompt_embeds:
        raise APIError(400, "prompt_embeds: prompts given as embeddings need the server flag --enable-prompt-embeds",
                       param="prompt_embeds", code="invalid_prompt_embeds")
    return await asyncio.to_thread(lambda: [_embeds(t, keep, side) for t in texts])


async def completion_prompts(engine, prompts: list, keep: int | None, side: str) -> list:
    """The engine prompts of a completions request: {'prompt': text, 'prompt_token_ids': ids} for a text,
    its ids for a token-id prompt, truncated to `keep` tokens. A text that cannot fit max_model_len is refused
    (400 context_length_exceeded) from its size before it is tokenized whole, unless it is to be truncated."""
    tok, L = engine.tokenizer, engine.max_model_len
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and tok is None:
        raise APIError(400, "this model has no tokenizer: give prompts as token ids", param="prompt")
    if keep is None:  # refused from its length alone before any work (a prefix tokenized below if needed)
        for text in texts:
            prompt_size.refused_unseen(tok, text, L, "prompt")
    encoded = await asyncio.to_thread(lambda: [_encode(tok, t, keep is None, L) for t in texts]) if texts else []
    out, it = [], iter(encoded)
    for p in prompts:
        if isinstance(p, str):
            ids = next(it)
            kept = truncate(ids, keep, side)  # cut: its text is that of the tokens kept (echo decodes them)
            out.append({"prompt": p if kept is ids else None, "prompt_token_ids": kept})
        else:
            out.append(truncate(list(p), keep, side))
    return out
