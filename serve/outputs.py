"""Engine outputs -> OpenAI objects: logprobs in both formats, usage, and per-choice stream deltas.

The engine's outputs are cumulative (all text and tokens so far); `Delta` remembers what a choice has
already sent, so a stream carries each piece of text and each token's logprobs exactly once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxpaged.engine import CompletionOutput, RequestOutput
from serve.errors import APIError
from serve.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    Logprob,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)


class TokenText:
    """Token id -> the text it stands for (cached); `token_id:N` without a tokenizer or with `as_ids`
    (return_tokens_as_token_ids)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tok, self.as_ids = tokenizer, as_ids
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            if self.tok is None or self.as_ids:
                s = f"token_id:{token_id}"
            else:
                s = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < 200_000:
                self.cache[token_id] = s
        return s

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        if self.tok is None:
            return ""
        return self.tok.decode(out.prompt_token_ids, skip_special_tokens=False)


ALL = -1  # a `k` that lists every entry in the engine's order: logprob_token_ids (the sampled token, then the ids)


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k best (ALL: every entry, in order); a masked token's -inf (logprobs_mode processed_*) as -9999.0,
    as vLLM (JSON has no inf)."""
    items = lp.items() if k == ALL else sorted(lp.items(), key=lambda kv: -kv[1])[:k]
    return [(t, max(v, -9999.0)) for t, v in items]


def _legacy_top(text: TokenText, tid: int, lp: dict[int, float], k: int) -> dict[str, float]:
    """A legacy `top_logprobs` entry, as vLLM's: the chosen token first, then the top k (so max(k, 1) to k + 1
    entries; logprobs 0: the chosen token alone). Two ids of one text: the first listed keeps it."""
    top = {text(tid): max(lp[tid], -9999.0)} if tid in lp else {}
    for t, v in _top(lp, k):
        top.setdefault(text(t), v)
    return top


def completion_logprobs(text: TokenText, token_ids, logprobs, k: int, offset: int) -> CompletionLogprobs:
    """Legacy completions format; offset is where the first token's text starts in the choice's text."""
    out = CompletionLogprobs()
    for tid, lp in zip(token_ids, logprobs or []):
        s = text(tid)
        out.tokens.append(s)
        out.token_logprobs.append(lp.get(tid))
        out.top_logprobs.append(_legacy_top(text, tid, lp, k))
        out.text_offset.append(offset)
        offset += len(s)
    return out


def echo_logprobs(text: TokenText, out: RequestOutput, k: int, then: CompletionLogprobs) -> CompletionLogprobs:
    """Completions with echo: the prompt's tokens (the first with null logprob and top_logprobs; offsets
    from 0 in the prompt's text; top_logprobs hold the prompt token first, then the top k), then `then`."""
    res = CompletionLogprobs()
    offset, lps = 0, out.prompt_logprobs or []
    for j, tid in enumerate(out.prompt_token_ids):
        lp = lps[j] if j < len(lps) else None
        s = text(tid)
        res.tokens.append(s)
        res.token_logprobs.append(None if lp is None else lp.get(tid))
        res.top_logprobs.append(None if lp is None else _legacy_top(text, tid, lp, k))
        res.text_offset.append(offset)
        offset += len(s)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(res, name).extend(getattr(then, name))
    return res


def prompt_logprobs(text: TokenText, out: RequestOutput, k: int | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token (the first null) {token id: Logprob}, the prompt token first,
    then the top k by rank (rank null for a prompt token outside them); None when not asked (k None)."""
    if k is None or out.prompt_logprobs is None:
        return None
    res = []
    for j, tid in enumerate(out.prompt_token_ids):
        lp = out.prompt_logprobs[j] if j < len(out.prompt_logprobs) else None
        if lp is None:
            res.append(None)
            continue
        top = _top(lp, k)
        ranks = {t: r for r, (t, _) in enumerate(top, 1)}
        entry = {str(tid): Logprob(logprob=max(lp.get(tid, -9999.0), -9999.0), rank=ranks.get(tid),
                                   decoded_token=text(tid))}
        for t, v in top:
            entry.setdefault(str(t), Logprob(logprob=v, rank=ranks[t], decoded_token=text(t)))
        res.append(entry)
    return res


def without_generated(out: RequestOutput) -> RequestOutput:
    """Completions with max_tokens 0 (the engine ran 1 token): the output without its generated token."""
    return dataclasses.replace(out, outputs=[dataclasses.replace(
        c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
        finish_reason="length" if c.finish_reason is not None else None) for c in out.outputs])


def chat_logprobs(text: TokenText, token_ids, logprobs, k: int) -> ChatLogprobs:
    content = []
    for tid, lp in zip(token_ids, logprobs or []):
        s = text(tid)
        top = [TopLogprob(token=text(t), logprob=v, bytes=list(text(t).encode())) for t, v in _top(lp, k)]
        content.append(ChatTokenLogprob(token=s, logprob=lp.get(tid, float("-inf")), bytes=list(s.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def routes(a) -> list | None:
    """Routed experts (an i32 array, return_routed_experts) as nested lists for JSON; None stays None."""
    return None if a is None else a.tolist()


def check_routes_request(req, num_prompts: int) -> None:
    """return_routed_experts is answered in one non-streamed response per prompt (400 otherwise)."""
    if req.return_routed_experts and (req.stream or num_prompts > 1):
        raise APIError(400, "return_routed_experts needs one prompt per request and stream false",
                       param="return_routed_experts", code="invalid_combination")


def usage(outs: list[RequestOutput | None], details: bool = False) -> Usage:
    """Token counts; with `details` (--enable-prompt-tokens-details) the prompt tokens the prefix cache
    served as prompt_tokens_details.cached_tokens (else null, as vLLM)."""
    done = [o for o in outs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done)
    completion = sum(len(c.token_ids) for o in done for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in done)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if details else None)


@dataclass
class Delta:
    """What one choice has sent so far in a stream."""
    text_len: int = 0
    num_tokens: int = 0
    done: bool = False

    def advance(self, c: CompletionOutput) -> tuple[str, list[int], list | None, str | None] | None:
        """New (text, token ids, logprobs, finish_reason) since the last call; None if nothing to send."""
        if self.done:
            return None
        text = c.text[self.text_len:] if len(c.text) >= self.text_len else ""
        ids = c.token_ids[self.num_tokens:]
        lps = c.logprobs[self.num_tokens:] if c.logprobs is not None else None
        self.done = c.finish_reason is not None
        if not text and not self.done and not (lps and ids):
            return None  # tokens with no text yet (a partial character) go with the next piece
        self.text_len, self.num_tokens = max(self.text_len, len(c.text)), len(c.token_ids)
        return text, ids, lps, c.finish_reason
