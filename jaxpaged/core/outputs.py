"""What the engine hands back: RequestOutput (one user request) and CompletionOutput (each of its samples)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxpaged.core.request import ListPrefix


@dataclass(init=False)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error" | None while running
    hidden_states: np.ndarray | None = None  # f32[num_generated, nL, D] (return_hidden_states; final output)
    # i32[num_generated - 1, L, k]: each generated token's experts but the last's (return_routed_experts; final)
    routed_experts: np.ndarray | None = None

    def __init__(self, index: int, text: str, token_ids, logprobs=None, finish_reason: str | None = None,
                 hidden_states: np.ndarray | None = None, routed_experts: np.ndarray | None = None):
        # token_ids and logprobs may be ListPrefixes, stored as given (one is built for every streamed
        # request every step: the properties' setters would cost a call each)
        self.index, self.text, self.finish_reason, self.hidden_states = index, text, finish_reason, hidden_states
        self.routed_experts = routed_experts
        self.__dict__["_token_ids"], self.__dict__["_logprobs"] = token_ids, logprobs


def _copied_when_read(name: str) -> property:
    """A dataclass field that may be given a ListPrefix, which becomes a list when first read."""
    attr = "_" + name

    def get(self):
        v = self.__dict__[attr]
        if isinstance(v, ListPrefix):
            v = self.__dict__[attr] = v.copy()
        return v

    def set_(self, v):
        self.__dict__[attr] = v
    return property(get, set_)


CompletionOutput.token_ids = _copied_when_read("token_ids")
CompletionOutput.logprobs = _copied_when_read("logprobs")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival_time, scheduled_time, first_token_time, last_token_time,
    # finished_time (time.monotonic()), inter_token_latencies (seconds), num_preemptions (its samples')
    error: str | None = None  # set when a failed step ended the request (finish_reason "error")
    prompt_hidden_states: np.ndarray | None = None  # f32[num_prompt_tokens, nL, D] (return_prompt_hidden_states)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else {token id: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_routed_experts: np.ndarray | None = None  # i32[num_prompt_tokens, L, k] (return_routed_experts; final)
    pooled: np.ndarray | None = None  # f32[D]: the pooled prompt states (SamplingParams.pooling; final output)
