"""SamplingParams: how to sample one request, validated on the host (no jax here).

The device half, the pure batched sampler that reads these values as per-slot arrays, is
`jaxpaged/step/sampler.py`.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass

import numpy as np

from jaxpaged.core.logit_controls import check_logit_controls
from jaxpaged.core.pooling import Pooling
from jaxpaged.core.structured import StructuredOutputsParams
from jaxpaged.core.validation import InvalidParam, check_text

INT32_MAX = 2 ** 31 - 1
SEED_MIN, SEED_END = -2 ** 63, 2 ** 63  # seeds are int64 (as vLLM's); the engine uses seed % 2**32
# Every running request with stop strings searches its new text for each of them on every step, and
# holds back (when streaming) a tail as long as its longest one: a bound on count and total length.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # all stop strings together, in characters (Unicode code points)
FLOAT32_MAX = 3.4028234663852886e38  # floats reach the step as float32: larger ones would become inf
MAX_LOGPROB_TOKEN_IDS = 128  # logprob_token_ids per request (vLLM's bound; the step's row width)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How to sample one request. Names and meanings follow vLLM; values are checked on creation (and
    again by `LLMEngine.add_request`, which also checks them against the model: vocabulary, lengths).

    Limits beyond vLLM's: integers stored by the step (top_k, token ids) fit int32; floats are finite
    and at most float32's largest value (3.4e38). `seed` is an integer in [-2**63, 2**63) (int64); the
    engine uses `seed % 2**32` (deterministic: equal seeds, equal samples). `stop`: at most
    MAX_STOP_STRINGS (16) strings, MAX_STOP_CHARS (1024) characters in all.
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
    # the logprobs of these ids at every generated position, beside the sampled token's (vLLM's; they take
    # the place of the top-N: `logprobs` becomes 0); at most MAX_LOGPROB_TOKEN_IDS, duplicates dropped
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained output
    # research hooks (docs/research.md); the engine must have compiled them (hidden_state_layers, steering_layers)
    return_hidden_states: bool = False          # CompletionOutput.hidden_states [generated, nL, D]
    return_prompt_hidden_states: bool = False   # RequestOutput.prompt_hidden_states [prompt, nL, D]
    steering_vectors: dict | None = None        # {layer: vector [hidden]} added at every position
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (RequestOutput.prompt_logprobs)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (finite)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (see jaxpaged/core/logit_controls.py)
    # MoE models: each token's top-k expert ids per layer, for routing replay (jaxpaged/step/routed_experts.py)
    return_routed_experts: bool = False  # RequestOutput.prompt_routed_experts, CompletionOutput.routed_experts
    # an embedding request (core/pooling.py; LLM.embed and the server set it): RequestOutput.pooled, max_tokens 1
    pooling: Pooling | None = None

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
            if not _is_int(self.seed) or not SEED_MIN <= self.seed < SEED_END:
                bad("seed", "must be None or an integer in [-2**63, 2**63) (int64)")
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
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"SamplingParams.stop has {len(self.stop)} strings; the limit is "
                                       f"{MAX_STOP_STRINGS}")
        chars = sum(len(s) for s in self.stop)
        if chars > MAX_STOP_CHARS:
            raise InvalidParam("stop", f"SamplingParams.stop has {chars} characters in all; the limit is "
                                       f"{MAX_STOP_CHARS}", "stop_too_long")
        for s in self.stop:
            check_text("stop", s)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            bad("stop_token_ids", f"must be a list of integers in [0, {INT32_MAX}]")
        self.stop_token_ids = [int(t) for t in ids]
        integer("logprobs", 0, optional=True)
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and 0 <= t <= INT32_MAX
                                                                        for t in ids):
                bad("logprob_token_ids", f"must be None or a non-empty list of integers in [0, {INT32_MAX}]")
            if len(ids) > MAX_LOGPROB_TOKEN_IDS:
                bad("logprob_token_ids", f"must hold at most {MAX_LOGPROB_TOKEN_IDS} ids (vLLM's bound)")
            self.logprob_token_ids = list(dict.fromkeys(int(t) for t in ids))
            self.logprobs = 0  # the sampled token's own logprob; the ids' come beside it
        integer("prompt_logprobs", 0, optional=True)
        check_logit_controls(self, bad)
        for name in ("ignore_eos", "skip_special_tokens", "return_hidden_states", "return_prompt_hidden_states",
                     "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams or None")
            self.structured_outputs.validate()
        self._validate_steering(bad)
        if self.pooling is not None and (not isinstance(self.pooling, Pooling) or self.max_tokens != 1
                                         or self.n != 1):  # a pooling request finishes after its prompt, alone
            bad("pooling", "must be None or a core.pooling.Pooling, with max_tokens 1 and n 1")

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
