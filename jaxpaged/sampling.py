"""SamplingParams (host, validated) and the pure batched sampler that runs inside the step.

Every slot carries its own parameters. A slot's random key is `fold_in(key(seed), index of the token
being generated)`, so a request's samples depend only on its own seed and tokens, never on the batch.
Logprobs are those of the model's raw distribution (log_softmax of the logits, before penalties,
temperature and filtering), as in vLLM.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.logit_controls import check_logit_controls
from jaxpaged.structured import StructuredOutputsParams
from jaxpaged.validation import InvalidParam, check_text

_NEG_INF = -jnp.inf


INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # floats reach the step as float32: larger ones would become inf


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How to sample one request. Names and meanings follow vLLM; values are checked on creation (and
    again by `LLMEngine.add_request`, which also checks them against the model: vocabulary, lengths).

    Limits beyond vLLM's: integers stored by the step (top_k, token ids) fit int32; floats are finite
    and at most float32's largest value (3.4e38). `seed` takes any integer; the engine uses
    `seed % 2**32` (deterministic: equal seeds, equal samples).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16    # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None    # top-N logprobs per generated token
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained output
    # research hooks (docs/research.md); the engine must have compiled them (hidden_state_layers, steering_layers)
    return_hidden_states: bool = False          # CompletionOutput.hidden_states [generated, nL, D]
    return_prompt_hidden_states: bool = False   # RequestOutput.prompt_hidden_states [prompt, nL, D]
    steering_vectors: dict | None = None        # {layer: vector [hidden]} added at every position
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (RequestOutput.prompt_logprobs)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (finite)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (see jaxpaged/logit_controls.py)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check (and normalize) every field; raise InvalidParam (a ValueError) naming the first bad one."""
        def bad(name, want, code=None):
            raise InvalidParam(name, f"SamplingParams.{name} {want}, got {getattr(self, name)!r}", code)

        def integer(name, lo, hi=INT32_MAX, optional=False):
            v = getattr(self, name)
            if v is None and optional:
                return
            if not _is_int(v) or not lo <= v <= hi:
                bad(name, f"must be an integer in [{lo}, {hi}]")
            setattr(self, name, int(v))

        def real(name, lo, hi, lo_open=False, what=None):
            v = getattr(self, name)
            if not _is_real(v) or not (lo < v if lo_open else lo <= v) or v > hi:
                bad(name, what or f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}]")
            setattr(self, name, float(v))

        integer("n", 1)
        real("temperature", 0, FLOAT32_MAX, what="must be a finite number >= 0 (0 is greedy)")
        real("top_p", 0, 1, lo_open=True)
        integer("top_k", -1)
        real("min_p", 0, 1)
        if self.seed is not None:
            if not _is_int(self.seed):
                bad("seed", "must be an integer or None")
            self.seed = int(self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            real(name, -2, 2)
        real("repetition_penalty", 0, FLOAT32_MAX, lo_open=True, what="must be a finite number > 0")
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})", "invalid_combination")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop = list(self.stop)
        for s in self.stop:
            check_text("stop", s)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            bad("stop_token_ids", f"must be a list of integers in [0, {INT32_MAX}]")
        self.stop_token_ids = [int(t) for t in ids]
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        check_logit_controls(self, bad)
        for name in ("ignore_eos", "skip_special_tokens", "return_hidden_states", "return_prompt_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams or None")
            self.structured_outputs.validate()
        self._validate_steering(bad)

    def _validate_steering(self, bad) -> None:
        """steering_vectors -> {layer: f32[hidden] numpy} (the model checks layers and sizes at add_request)."""
        if not self.steering_vectors:
            self.steering_vectors = None
            return
        if not isinstance(self.steering_vectors, dict):
            bad("steering_vectors", "must be a dict {layer index: vector} or None")
        out = {}
        for layer, vec in self.steering_vectors.items():
            try:
                v = np.asarray(vec, dtype=np.float32)
            except (TypeError, ValueError):
                v = None
            if not _is_int(layer) or layer < 0 or v is None or v.ndim != 1 or not np.isfinite(v).all():
                bad("steering_vectors", "must map layer indices (integers >= 0) to 1-D vectors of finite numbers")
            out[int(layer)] = v
        self.steering_vectors = out

    @property
    def steering_key(self) -> str | None:
        """A digest of the steering vectors (None without): part of the prefix-cache key of KV blocks."""
        if not self.steering_vectors:
            return None
        h = hashlib.sha256()
        for layer in sorted(self.steering_vectors):
            h.update(layer.to_bytes(4, "little") + self.steering_vectors[layer].tobytes())
        return h.hexdigest()

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _penalize(logits, h):
    """vLLM's penalties from the token history: repetition over prompt+output, the others output only."""
    S, V = logits.shape
    hist, plen, hlen = h["history"], h["prompt_len"], h["history_len"]  # [S, M], [S], [S]
    pos = jnp.arange(hist.shape[1])[None, :]
    ids = jnp.where((pos < hlen[:, None]) & (hist >= 0), hist, V)  # V = dropped
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], ids.shape)
    is_out = (pos >= plen[:, None]).astype(jnp.int32)
    counts = jnp.zeros((S, V), jnp.int32).at[rows, ids].add(is_out, mode="drop")  # output counts
    seen = jnp.zeros((S, V), jnp.bool_).at[rows, ids].set(True, mode="drop")  # prompt or output
    rep = h["repetition_penalty"][:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - h["frequency_penalty"][:, None] * counts
    return logits - h["presence_penalty"][:, None] * (counts > 0)


def _apply_bitmask(logits, bitmask):
    """Mask to -inf the tokens whose bit is 0. bitmask i32[S, W]: bit j of word w is token 32*w + j."""
    S, V = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V].astype(jnp.bool_)  # [S, V]
    return jnp.where(allowed, logits, _NEG_INF)


def _apply_bias(logits, ids, values):
    """Add values f32[S, NB] to the logits of ids i32[S, NB] (-1 = none): logit_bias and bad-word bans."""
    S, V = logits.shape
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], ids.shape)
    return logits.at[rows, jnp.where(ids >= 0, ids, V)].add(values, mode="drop")


def _filter(scaled, sp):
    """Mask tokens outside top_k / top_p / min_p (per slot) to -inf. scaled: [S, V] logits/temperature."""
    V = scaled.shape[1]
    srt = -jnp.sort(-scaled, axis=-1)  # [S, V] descending
    k = jnp.where(sp["top_k"] > 0, jnp.minimum(sp["top_k"], V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)  # [S, 1]
    probs = jax.nn.softmax(srt, axis=-1)
    cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
    keep_sorted = cum < sp["top_p"][:, None]
    n_keep = jnp.maximum(keep_sorted.sum(-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
    mth = srt[:, :1] + jnp.log(jnp.maximum(sp["min_p"][:, None], 1e-38))  # p >= min_p * p_max
    thresh = jnp.maximum(jnp.maximum(kth, pth), jnp.where(sp["min_p"][:, None] > 0, mth, -jnp.inf))
    return jnp.where(scaled >= thresh, scaled, _NEG_INF)


def slot_rows(sp: dict, at, num_slots: int) -> dict:
    """The sampler's inputs for rows of the slots `at` i32[R]: every per-slot array (leading axis
    num_slots) gathered, the flags (0-d) kept."""
    return {k: v[at] if jnp.ndim(v) and v.shape[0] == num_slots else v for k, v in sp.items()}


def sample(logits, sp, num_logprobs: int):
    """Sample one token per slot.

    logits f32[S, V]; sp: dict of per-slot arrays — temperature f32[S], top_k i32[S], top_p f32[S],
    min_p f32[S], seed u32[S], gen_index i32[S], banned i32[S, NB] (ids masked, -1 = none),
    history i32[S, M], prompt_len/history_len i32[S], presence/frequency/repetition_penalty f32[S],
    bitmask i32[S, ceil(V/32)] (grammar and allowed_token_ids masks: 0 bits are masked, all ones when
    unconstrained), bias_ids i32[S, NB] / bias_values f32[S, NB] (logit_bias and bad-word bans, -1 = none),
    any_penalty, any_filter, any_mask, any_bias, all_greedy, any_logprobs: bool[].
    Returns tokens i32[S], token_logprob f32[S], top_logprobs f32[S, K], top_ids i32[S, K] (the last three
    zeros when no slot asked for logprobs: any_logprobs false).
    """
    S, V = logits.shape
    raw = logits  # logprobs are the model's: before bias, penalties, masks and temperature
    logits = jax.lax.cond(sp["any_bias"], _apply_bias, lambda l, i, v: l, logits, sp["bias_ids"],
                          sp["bias_values"])
    logits = jax.lax.cond(sp["any_penalty"], _penalize, lambda l, h: l, logits, sp)
    banned = sp["banned"]
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], banned.shape)
    logits = logits.at[rows, jnp.where(banned >= 0, banned, V)].set(_NEG_INF, mode="drop")
    logits = jax.lax.cond(sp["any_mask"], _apply_bitmask, lambda l, m: l, logits, sp["bitmask"])
    greedy_tok = jnp.argmax(logits, axis=-1)

    def sampled(logits):
        temp = jnp.where(sp["temperature"] > 0, sp["temperature"], 1.0)
        scaled = logits / temp[:, None]
        scaled = jax.lax.cond(sp["any_filter"], _filter, lambda s, _: s, scaled, sp)

        def one(seed, idx, row):
            key = jax.random.fold_in(jax.random.key(seed), idx)
            return jnp.argmax(row + jax.random.gumbel(key, row.shape, row.dtype))
        drawn = jax.vmap(one)(sp["seed"], sp["gen_index"], scaled)
        return jnp.where(sp["temperature"] > 0, drawn, greedy_tok)

    tokens = jax.lax.cond(sp["all_greedy"], lambda l: greedy_tok, sampled, logits).astype(jnp.int32)

    def logprobs(raw, tokens):  # log_softmax and top-k over [S, V] cost ms a step on CPU: only when asked
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_lp, top_ids.astype(jnp.int32)

    def not_asked(raw, tokens):
        return (jnp.zeros((S,), raw.dtype), jnp.zeros((S, num_logprobs), raw.dtype),
                jnp.zeros((S, num_logprobs), jnp.int32))

    tok_lp, top_lp, top_ids = jax.lax.cond(sp["any_logprobs"], logprobs, not_asked, raw, tokens)
    return tokens, tok_lp, top_lp, top_ids
