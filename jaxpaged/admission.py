"""Admission: a user's request checked against the engine, then made into a group of n samples.

Everything a step will use is checked here, each part by its own checker (the SamplingParams, the
prompt, the grammar, speculative decoding, research hooks, routed experts, bad words, then the limits
of the model and the KV pool in `core/validation.py`), so a request that is accepted cannot make a step
fail. A prompt may come as embeddings (`core/prompt_embeds.py`). A check that fails raises ValueError
(InvalidParam names the field) and nothing is queued.
"""
from __future__ import annotations

import itertools
import time

import numpy as np

from jaxpaged.core import prompt_embeds
from jaxpaged.core.batch import NUM_BANNED
from jaxpaged.core.logit_controls import bad_words_token_ids
from jaxpaged.core.output_processor import Group
from jaxpaged.core.request import Request
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.tokenizer import IncrementalDetokenizer
from jaxpaged.core.validation import InvalidParam, check_request, prompt_ids
from jaxpaged.step import routed_experts
from jaxpaged.step.research import check_params


class Admission:
    """The engine's request checks, request ids and the seeds of requests that give none."""

    def __init__(self, engine):
        self.engine = engine
        self.rng = np.random.default_rng(engine.config.seed)
        self.ids = itertools.count()

    def limits(self) -> dict:
        """The model-dependent bounds every request is checked against (the server states them in its schema)."""
        e = self.engine
        return dict(vocab_size=e.model_config.vocab_size, max_model_len=e.max_model_len,
                    max_logprobs=e.runner.num_logprobs, max_banned_ids=NUM_BANNED, num_eos_ids=len(e.eos_token_ids))

    def group(self, request_id: str | None, prompt, params: SamplingParams | None, arrival_time: float | None,
              stream: bool, lora_request) -> Group:
        """Check a request (raise, nothing queued, if it is invalid) and make its group of samples."""
        e, cfg, mc = self.engine, self.engine.config, self.engine.model_config
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: fields may have been changed since creation
        request_id = str(next(self.ids)) if request_id is None else str(request_id)
        if request_id in e.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        embeds = None
        if isinstance(prompt, dict) and prompt_embeds.PARAM in prompt:  # placeholder ids: one per position
            embeds = prompt_embeds.check(prompt, cfg.enable_prompt_embeds, mc.hidden_size, e.max_model_len, params)
            text, ids = None, [0] * len(embeds)
        else:
            text, ids = prompt_ids(prompt, e.tokenizer, e.model_dir)
        lora_int_id = e.lora.lora_int_id(lora_request)
        e.structured.check(params)
        e.spec.check(params)
        check_params(params, tuple(cfg.hidden_state_layers or ()), tuple(cfg.steering_layers or ()), mc.hidden_size)
        routed_experts.check_params(params, mc)
        if params.pooling is not None and not cfg.pooling:
            raise InvalidParam("pooling", "embeddings need an engine started with runner='pooling' (--runner "
                                          "pooling) or convert='embed'")
        if params.logprob_token_ids and cfg.logprobs_mode.startswith("processed"):
            raise InvalidParam("logprob_token_ids", f"logprob_token_ids are read from the raw logits; this engine's "
                               f"logprobs_mode is {cfg.logprobs_mode}")
        if params.bad_words and e.tokenizer is None:
            raise InvalidParam("bad_words", f"bad_words need a tokenizer; {e.model_dir} has none")
        bad_words = bad_words_token_ids(params.bad_words, e.tokenizer) if params.bad_words else []
        budget = cfg.max_num_batched_tokens
        max_tokens = check_request(ids, params, self.limits(), lambda n: e.block_manager.max_blocks_held(n, budget),
                                   e.num_blocks - 1)
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        base_seed = int(self.rng.integers(2 ** 32)) if params.seed is None else params.seed % 2 ** 32
        now = time.monotonic() if arrival_time is None else arrival_time
        samples, detoks = [], []
        for i in range(params.n):
            req = Request(request_id=request_id if params.n == 1 else f"{request_id}#{i}", group_id=request_id,
                          index=i, prompt_token_ids=ids, params=params,
                          seed=(base_seed + i * 0x9E3779B9) % 2 ** 32, eos_token_ids=e.eos_token_ids,
                          arrival=now, sibling=samples[0] if samples else None, bad_words_token_ids=bad_words,
                          lora_int_id=lora_int_id, prompt_embeds=embeds)
            samples.append(req)
            detoks.append(IncrementalDetokenizer(e.tokenizer, ids, params.stop, params.skip_special_tokens,
                                                 context=embeds is None))
        return Group(request_id, text, ids, samples, detoks, now, bool(stream))
