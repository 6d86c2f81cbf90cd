"""Prompts given as embeddings (vLLM's `{"prompt_embeds": array[prompt_len, hidden]}`): checked on the host.

The embeddings stand for the output of the token lookup (the raw rows of the embedding table; as vLLM reads them,
before Gemma 2's sqrt(hidden) scale and after Gemma 3's, which takes them as given): the step feeds them
to the first layer in place of the lookup at the prompt's positions (jaxpaged/step/prompt_embeds.py);
the tokens generated after the prompt take the ordinary lookup. The request's prompt token ids are
placeholders (0), as vLLM's engine keeps them: they count the prompt's positions and key nothing, so
the blocks of such a request never enter the prefix cache (`Request.cacheable`).

Host only (numpy): a jax array, a numpy array or anything `np.asarray` reads (a CPU torch tensor) is taken,
in any floating-point dtype (bfloat16 included), and kept as float32 [prompt_len, hidden] until the step
casts it to the engine's dtype.
"""
from __future__ import annotations

import numpy as np

from jaxpaged.core.validation import InvalidParam

PARAM = "prompt_embeds"


def _refuse(message: str, code: str = "invalid_prompt_embeds") -> InvalidParam:
    return InvalidParam(PARAM, f"prompt_embeds: {message}", code=code)


def as_array(value) -> np.ndarray:
    """`value` as float32 [prompt_len, hidden] (a leading axis of size 1 dropped, as vLLM does); InvalidParam
    naming prompt_embeds when it is no array, not 2-D, not floating-point, empty or not finite."""
    try:
        a = np.asarray(value)
    except Exception as e:  # noqa: BLE001 -- whatever the object raises, it is no array we can read
        raise _refuse(f"not an array ({type(value).__name__}: {e})") from None
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 (jax arrays) is kind 'V'
        raise _refuse(f"dtype {a.dtype.name} is not a floating-point type (give float32, bfloat16 or float16)")
    if a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2:
        raise _refuse(f"must be a 2-D array of shape (prompt_len, hidden_size); got shape {tuple(a.shape)}")
    if a.shape[0] == 0:
        raise _refuse("is empty (it has no positions)", code="empty_prompt")
    a = np.ascontiguousarray(a, np.float32)
    if not np.isfinite(a).all():
        raise _refuse("holds non-finite values (NaN or infinity)")
    return a


def check(prompt: dict, enabled: bool, hidden_size: int, max_model_len: int, params) -> np.ndarray:
    """The embeddings of an embeddings prompt (a dict with the key 'prompt_embeds'), checked against the
    engine: enable_prompt_embeds, the model's hidden size, max_model_len, and the request's options that
    need the prompt's token ids. Returns float32 [prompt_len, hidden]."""
    if not enabled:
        raise _refuse("prompts given as embeddings need the engine flag enable_prompt_embeds "
                      "(--enable-prompt-embeds)")
    others = sorted(k for k in prompt if k != PARAM)
    if others:
        raise _refuse(f"an embeddings prompt takes no other keys (got {', '.join(map(repr, others))}): give "
                      "either prompt_embeds or token ids / text")
    a = as_array(prompt[PARAM])
    if a.shape[1] != hidden_size:
        raise _refuse(f"hidden size {a.shape[1]} does not match the model's hidden_size {hidden_size}")
    if a.shape[0] >= max_model_len:
        raise _refuse(f"has {a.shape[0]} positions; max_model_len is {max_model_len} (a prompt must leave room "
                      "for at least one generated token)", code="context_length_exceeded")
    if params.prompt_logprobs is not None:
        raise _refuse("prompt_logprobs are not available for a prompt given as embeddings (it has no token ids)",
                      code="invalid_combination")
    return a
