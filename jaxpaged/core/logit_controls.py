"""Logit controls (host, numpy only): `logit_bias`, `allowed_token_ids` and `bad_words` of SamplingParams,
with vLLM's names and meanings, turned into the per-slot arrays the step applies on device.

- `logit_bias` {token id: bias} and the bans of `bad_words` travel as one sparse per-slot list,
  `bias_ids i32[S, NUM_BIAS]` (-1 = none) and `bias_values f32[S, NUM_BIAS]` (a ban is -inf), added
  to the logits before penalties and sampling (`sampling._apply_bias`).
- `allowed_token_ids` goes through the grammar bitmask (`bitmask i32[S, W]` of `structured.py`): the
  slot's row holds its allowed set, ANDed with its grammar's if it has one. Any size up to the vocabulary.
- `bad_words` (vLLM): each word is tokenized alone and with a leading space (the second kept only when
  it has as many tokens as the first and starts differently). A word of one token is always banned; a
  longer one bans its last token whenever the generated tokens end with its other tokens. Only the
  generated tokens count, not the prompt; so the host needs each new token before the next step.

A slot's rows are written only in steps where it samples; when no scheduled slot uses a control the step
gets constant arrays that stay on the device, and the flag `any_bias` is off: nothing is computed.
Logprobs stay those of the raw distribution (before any control), as in vLLM.

Limits (a ValueError naming the field beyond them): logit_bias at most MAX_LOGIT_BIAS entries, each bias
finite with |bias| <= MAX_ABS_BIAS; at most MAX_BAD_WORDS bad words; allowed_token_ids non-empty. Token
ids must be in the vocabulary (checked against the model by `validation.check_request`).
"""
from __future__ import annotations

import math
import numbers
import weakref

import numpy as np

from jaxpaged.core.validation import InvalidParam, check_text

MAX_LOGIT_BIAS = 300
MAX_ABS_BIAS = 1e9
MAX_BAD_WORDS = 32
NUM_BIAS = MAX_LOGIT_BIAS + 2 * MAX_BAD_WORDS  # each bad word bans at most 2 tokens (its 2 tokenizations)
_INT32_MAX = 2 ** 31 - 1


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_logit_controls(p, bad) -> None:
    """Validate and normalize p.logit_bias, p.allowed_token_ids, p.bad_words (SamplingParams);
    `bad(name, want)` raises the InvalidParam."""
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            bad("logit_bias", "must be a dict {token id: bias}")
        if len(p.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"SamplingParams.logit_bias has {len(p.logit_bias)} entries; "
                                             f"the limit is {MAX_LOGIT_BIAS}")
        for k, v in p.logit_bias.items():
            if not _is_int(k) or not 0 <= k <= _INT32_MAX:
                raise InvalidParam("logit_bias", f"SamplingParams.logit_bias keys must be token ids (integers "
                                                 f">= 0), got {k!r}")
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                    or abs(v) > MAX_ABS_BIAS:
                raise InvalidParam("logit_bias", f"SamplingParams.logit_bias values must be finite numbers in "
                                                 f"[-{MAX_ABS_BIAS:g}, {MAX_ABS_BIAS:g}], got {v!r} for {k}")
        p.logit_bias = {int(k): float(v) for k, v in p.logit_bias.items()}
    if p.allowed_token_ids is not None:
        ids = p.allowed_token_ids
        if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and 0 <= t <= _INT32_MAX
                                                                    for t in ids):
            raise InvalidParam("allowed_token_ids", "SamplingParams.allowed_token_ids must be a non-empty list "
                                                    f"of token ids (integers >= 0), got {str(ids)[:200]}")
        p.allowed_token_ids = sorted({int(t) for t in ids})
    if p.bad_words is not None:
        words = p.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            bad("bad_words", "must be a list of non-blank strings")
        if len(words) > MAX_BAD_WORDS:
            raise InvalidParam("bad_words", f"SamplingParams.bad_words has {len(words)} words; the limit is "
                                            f"{MAX_BAD_WORDS}")
        for w in words:
            check_text("bad_words", w)
        p.bad_words = list(words)


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """The token sequences of bad words, as vLLM forms them (see the module docstring)."""
    out: list[list[int]] = []
    for w in words:
        plain = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return [s for s in out if s]


def banned_by_bad_words(seqs: list[list[int]], output: list[int]) -> list[int]:
    """Tokens the bad-word sequences ban after the generated tokens `output`."""
    out = []
    for s in seqs:
        n = len(s) - 1
        if n == 0 or (len(output) >= n and output[len(output) - n:] == s[:-1]):
            out.append(s[-1])
    return out


def allowed_row(ids: list[int], words: int) -> np.ndarray:
    """The bitmask row (i32[words]) that allows exactly `ids` (bit j of word w is token 32*w + j)."""
    ids = np.asarray(ids, np.int64)
    row = np.zeros(words, np.uint32)
    np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return row.view(np.int32)


def _samples(req, n: int) -> bool:
    """The request samples this step: its chunk reaches its last token (then its proposals, if any)."""
    return req.num_computed_tokens + n == len(req.token_ids) + len(req.spec_token_ids)


class LogitControls:
    """The step's sparse bias arrays for the slots that use logit_bias or bad_words (the requests added to
    `requests`: a step with none of them scheduled costs one check)."""

    def __init__(self, max_num_seqs: int):
        self.ids = np.full((max_num_seqs, NUM_BIAS), -1, np.int32)      # [S, NB]
        self.values = np.zeros((max_num_seqs, NUM_BIAS), np.float32)    # [S, NB]
        self._dirty: list[int] = []
        self.none = dict(bias_ids=self.ids.copy(), bias_values=self.values.copy())  # placed by step.features
        self.requests: weakref.WeakSet = weakref.WeakSet()  # requests that use these controls (`track`)

    def arrays(self, scheduled) -> dict:
        """bias_ids i32[S, NB], bias_values f32[S, NB], any_bias bool[] for (request, tokens) pairs."""
        todo = [req for req, n in scheduled if req in self.requests and _samples(req, n)] if self.requests else []
        if not todo:
            return dict(self.none, any_bias=np.bool_(False))
        for s in self._dirty:
            self.ids[s], self.values[s] = -1, 0
        self._dirty = [req.slot for req in todo]
        for req in todo:
            bias = req.params.logit_bias or {}
            ban = banned_by_bad_words(req.bad_words_token_ids, req.output_token_ids)
            ids = list(bias) + ban
            self.ids[req.slot, :len(ids)] = ids
            self.values[req.slot, :len(ids)] = list(bias.values()) + [-np.inf] * len(ban)
        # copies: the step may still read these (CPU inputs can alias host memory) when the next are filled
        return dict(bias_ids=self.ids.copy(), bias_values=self.values.copy(), any_bias=np.bool_(True))
