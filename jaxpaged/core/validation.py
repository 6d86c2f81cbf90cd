"""Checks of a request against the served model, before it is queued (host only: numpy at most).

`SamplingParams` checks what it can alone (types, ranges, finite floats, int32 bounds); this module
checks the rest against the model: the prompt (valid Unicode, tokens in the vocabulary, room to
generate), and the params' vocabulary-, length- and step-dependent bounds. A request that passes cannot
make a step fail. Every refusal is an `InvalidParam` naming the parameter (the server's 400 `param`).
"""
from __future__ import annotations

import numpy as np


class InvalidParam(ValueError):
    """A ValueError about one request parameter; `param` names it, `code` (optional) classifies it
    (context_length_exceeded, empty_prompt, invalid_combination)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_text(name: str, text: str) -> None:
    """Raise InvalidParam unless `text` is valid Unicode (no lone UTF-16 surrogates such as '\\ud800')."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParam(name, f"{name} is not valid Unicode: lone surrogate {text[e.start]!r} at "
                                 f"character {e.start}") from None


def prompt_ids(prompt, tokenizer, model_dir: str) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string, a list of token ids or {'prompt_token_ids': [...]}
    (with 'prompt': its text, already tokenized elsewhere, as the server does off the engine thread)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidParam("prompt", f"{model_dir} has no tokenizer files: give prompts as "
                               "{'prompt_token_ids': [...]}")
        check_text("prompt", prompt)
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise InvalidParam("prompt", "a dict prompt needs the key 'prompt_token_ids'")
        ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidParam("prompt", "a dict prompt's 'prompt' is its text (a string)")
    else:
        ids = prompt
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
        raise InvalidParam("prompt", "prompt must be a string, a list of token ids (integers) or "
                           f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    return (text if isinstance(prompt, dict) else None), [int(t) for t in ids]


def check_request(ids: list[int], params, limits: dict, blocks_held, usable_blocks: int) -> int:
    """Check a tokenized request and its SamplingParams against `limits` (LLMEngine.request_limits());
    `blocks_held(num_tokens)` is the most KV blocks a request of that length holds at once
    (BlockManager.max_blocks_held). Return its effective max_tokens (None means up to max_model_len)."""
    V, L, NB = limits["vocab_size"], limits["max_model_len"], limits["max_banned_ids"]
    if not ids:
        raise InvalidParam("prompt", "prompt is empty (it has no tokens)", code="empty_prompt")
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise InvalidParam("prompt", f"prompt token id {bad[0]} is out of vocabulary (vocab_size {V})")
    if len(ids) >= L:
        raise InvalidParam("prompt", f"prompt has {len(ids)} tokens; max_model_len is {L} (a prompt must "
                           "leave room for at least one generated token)", code="context_length_exceeded")
    max_tokens = params.max_tokens if params.max_tokens is not None else L - len(ids)
    if len(ids) + max_tokens > L:
        raise InvalidParam("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                           f"max_model_len ({L})", code="context_length_exceeded")
    need = blocks_held(len(ids) + max_tokens)
    if need > usable_blocks:
        raise InvalidParam("max_tokens", f"request needs {need} KV blocks, the pool has {usable_blocks}",
                           code="context_length_exceeded")
    if params.min_tokens > max_tokens:
        raise InvalidParam("min_tokens", f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})",
                           code="invalid_combination")
    if params.top_k > V:
        raise InvalidParam("top_k", f"top_k ({params.top_k}) exceeds the vocabulary size ({V})")
    bad = [t for t in params.stop_token_ids if t >= V]
    if bad:
        raise InvalidParam("stop_token_ids", f"stop token id {bad[0]} is out of vocabulary (vocab_size {V})")
    if params.logprobs is not None and params.logprobs > limits["max_logprobs"]:
        raise InvalidParam("logprobs", f"logprobs ({params.logprobs}) exceeds max_logprobs "
                           f"({limits['max_logprobs']})")
    if params.prompt_logprobs is not None and params.prompt_logprobs > limits["max_logprobs"]:
        raise InvalidParam("prompt_logprobs", f"prompt_logprobs ({params.prompt_logprobs}) exceeds max_logprobs "
                           f"({limits['max_logprobs']})")
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("logprob_token_ids", params.logprob_token_ids or ())):
        bad = sorted({t for t in ids if t >= V})
        if bad:  # every bad key named (at most 32 of them: the message stays bounded)
            more = f" and {len(bad) - 32} more" if len(bad) > 32 else ""
            many = len(bad) > 1
            raise InvalidParam(name, f"{name} token id{'s' if many else ''} {', '.join(map(str, bad[:32]))}{more} "
                               f"{'are' if many else 'is'} out of vocabulary (vocab_size {V})",
                               code="invalid_token_id")
    banned = (0 if params.ignore_eos else limits["num_eos_ids"]) + len(params.stop_token_ids)
    if params.min_tokens and banned > NB:
        raise InvalidParam("stop_token_ids", f"min_tokens bans the EOS and stop token ids until it is reached: "
                           f"at most {NB} together ({limits['num_eos_ids']} EOS ids unless ignore_eos), "
                           f"got {banned}")
    return max_tokens
