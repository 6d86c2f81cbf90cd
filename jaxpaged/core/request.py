"""Host state of one request (one sample of a user request; `n > 1` makes n of these, one group)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxpaged.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str                       # unique per sample: "<group id>" or "<group id>#<index>"
    group_id: str                         # the user's request id
    index: int                            # which of the group's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                             # effective seed (the user's, or drawn by the engine)
    eos_token_ids: frozenset[int] = frozenset()
    arrival: float = 0.0
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0          # tokens whose K/V are in the pool
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[tuple] = field(default_factory=list)  # prefix-cache keys of full blocks, in order
    blocks_epoch: int = 0                 # bumped whenever block_ids is released (preemption, finish, trim)
    num_registered_blocks: int = 0        # leading full blocks already offered to the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None = None
    scheduled_time: float | None = None   # when the scheduler first gave it a slot (vLLM's scheduled_ts)
    sibling: "Request | None" = None      # the group's sample 0, whose prompt blocks this one shares
    hidden_states: dict | None = None     # token index -> f32[nL, D] (return_hidden_states)
    prompt_hidden_states: object = None   # f32[num_prompt_tokens, nL, D] (return_prompt_hidden_states)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # sample 0 collects them (prompt_logprobs)
    routed_experts: object = None         # i32[capacity, L, k] by position (return_routed_experts)
    num_routed: int = 0                   # positions [0, num_routed) hold their routed experts
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    lora_int_id: int = 0                  # the LoRA adapter it runs with (0: the base model)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals scheduled after the last token
    # f32[num_prompt_tokens, D]: the prompt given as embeddings (core/prompt_embeds.py); its prompt token
    # ids are then placeholders (0)
    prompt_embeds: object = None
    pooled: object = None  # f32[D] (params.pooling): the pooled prompt states so far (MEAN: their sum), then the vector
    stop_ids: frozenset[int] = field(init=False, default=frozenset())  # EOS (unless ignored) + stop ids
    # the host needs the last sampled token to prepare the next step (penalty history, grammar matcher,
    # bad words), so with async scheduling that token cannot stay on the device
    needs_last_token: bool = field(init=False, default=False)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.stop_ids = frozenset(self.params.stop_token_ids).union(
            () if self.params.ignore_eos else self.eos_token_ids)
        p = self.params
        self.needs_last_token = p.uses_penalties or p.structured_outputs is not None or bool(p.bad_words)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.return_hidden_states and self.hidden_states is None:
            self.hidden_states = {}
        if self.params.prompt_logprobs is not None and self.index == 0 and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt token's logprobs are still missing: the prefix cache is bypassed for this request."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def needs_routes(self) -> bool:
        """return_routed_experts, and a prefix-cache hit could skip a position whose routed experts are
        still missing: the cache is bypassed (jaxpaged/step/routed_experts.py). Samples after the first
        need none of the prompt's (the output's prompt_routed_experts are sample 0's)."""
        if not self.params.return_routed_experts:
            return False
        have = max(self.num_routed, self.num_prompt_tokens if self.index else 0)
        return have < len(self.token_ids) - 1

    @property
    def needs_every_position(self) -> bool:
        """Pooling that reads positions a prefix-cache hit would skip (MEAN, CLS): the cache is not matched."""
        return self.params.pooling is not None and self.params.pooling.every_position

    @property
    def cacheable(self) -> bool:
        """Whether its blocks may enter (and be served by) the prefix cache: not when its prompt came as
        embeddings, whose placeholder token ids would key blocks of different contents alike."""
        return self.prompt_embeds is None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class ListPrefix:
    """`items[start:end]` of a list that changes only past `end` (a request's token ids, its logprobs),
    copied when first read: an output built every step costs O(1) until someone reads it."""
    __slots__ = ("items", "start", "end")

    def __init__(self, items: list, start: int, end: int):
        self.items, self.start, self.end = items, start, end

    def copy(self) -> list:
        return self.items[self.start:self.end]
