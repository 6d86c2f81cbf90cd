"""LLM: offline generation, scoring, embeddings and the engine's controls over an `Engine` (jaxpaged/contract.py: one
LLMEngine, replicas, or a multi-host job's leader)."""
from __future__ import annotations

import itertools

from jaxpaged.config import EngineConfig
from jaxpaged.contract import ControlsFront, Engine, EngineControls
from jaxpaged.core.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    candidates,
    check_beam_search,
)
from jaxpaged.core.outputs import RequestOutput
from jaxpaged.core.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    pairs,
)
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.tokenizer import Tokenizer
from jaxpaged.core.validation import prompt_ids


def _is_one_prompt(prompts) -> bool:
    """A single prompt (a string, a dict, a list of token ids) rather than a list of them."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                and isinstance(prompts[0], int))


def _prompt_list(prompts) -> list:
    return [prompts] if _is_one_prompt(prompts) else list(prompts)


def _per_prompt(value, n: int, what: str) -> list:
    """`value` for each of n prompts: a list of one each, or one for all."""
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ValueError(f"{len(values)} {what} for {n} prompts")
    return values


class LLM(ControlsFront):
    """Offline generation: `LLM(model=DIR, ...).generate(prompts, SamplingParams(...))`.

    Keyword arguments are EngineConfig fields (model, dtype, block_size, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, max_model_len, enable_prefix_caching, attention_backend, tensor_parallel_size,
    ...). With no model, the embedded default model (SmolLM2-135M-Instruct) is fetched and converted once.

    Scale-out (docs/scale-out.md): `data_parallel_size=M` runs M replicas behind this one object;
    `coordinator_address`, `num_processes`, `process_id` (as in `jax.distributed.initialize`) make one
    engine over every process's devices, process 0 generating and the others following.

    The engine's controls (`controls`, documented in jaxpaged/contract.py's `EngineControls`) read as the
    LLM's own attributes, under vLLM's names: `llm.pause_generation(mode)`, `llm.sleep(level)`,
    `llm.update_weights(weights)`, `llm.add_lora(lora_request)`, ...
    """

    def __init__(self, model: str | None = None, **kwargs):
        if kwargs.get("num_processes", 1) > 1:  # before anything starts JAX's backends
            from jaxpaged.parallel.multihost import initialize
            initialize(kwargs.get("coordinator_address"), kwargs["num_processes"], kwargs.get("process_id", 0))
        from jaxpaged.parallel.replicas import build_engine
        self.engine = build_engine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """`LLM`'s generate/chat around an engine built by hand (e.g. `LLMEngine(config, devices)`)."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    @property
    def is_leader(self) -> bool:
        """False on a follower process of a multi-host job: its LLM(...) ran the leader's steps and returned
        when the leader stopped; it cannot generate."""
        return self.engine is not None

    @property
    def controls(self) -> EngineControls:
        """The engine's pause, sleep, weights and LoRA adapters."""
        return self._leader().controls

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._leader().tokenizer

    def _leader(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("this process follows process 0 of a multi-host job; only process 0 generates")
        return self.engine

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generate for each prompt (string, token-id list, {'prompt_token_ids': [...]} or, with
        enable_prompt_embeds, {'prompt_embeds': float array [prompt_len, hidden]}: embeddings fed in place of the
        token lookup, jaxpaged/core/prompt_embeds.py), in input order.
        `lora_request`: a LoRARequest for every prompt, or a list of one (or None) per prompt.

        Every prompt is validated before any is queued, so a bad one raises ValueError and runs nothing."""
        prompts = _prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling params")
        loras = _per_prompt(lora_request, len(prompts), "lora requests")
        eng = self._leader()
        if eng.controls.is_paused or eng.controls.sleep_level:
            raise RuntimeError("generate: the engine is paused or asleep; call resume_generation() / wake_up()")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras):
                eng.add_request(rid, prompt, p, stream=False, **({} if lora is None else dict(lora_request=lora)))
        except ValueError:
            for rid in ids:
                eng.abort_request(rid)
            raise
        from tqdm.auto import tqdm
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req",
                  disable=not (use_tqdm and eng.config.show_progress)) as bar:
            while len(done) < len(ids) and eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
                        bar.update(1)
        return [done[i] for i in ids]

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (jaxpaged/core/beam_search.py): for each prompt (as `generate` takes them), the
        `params.beam_width` best sequences, best first; each one's `tokens` and `text` include the prompt.
        One engine step per iteration for all live beams of all prompts; a beam forks from its parent through
        the prefix cache (the parent's full blocks are shared, only its partial last block is recomputed)."""
        eng = self._leader()
        check_beam_search(params, eng.config.logprobs_mode, eng.request_limits()["max_logprobs"],
                          eng.config.enable_prefix_caching)
        prompts = _prompt_list(prompts)
        ids = [prompt_ids(p, eng.tokenizer, eng.config.model)[1] for p in prompts]
        loras = _per_prompt(lora_request, len(prompts), "lora requests")
        search = BeamSearch(ids, params, eng.eos_token_ids, eng.max_model_len)
        step = search.step_params()
        from tqdm.auto import tqdm
        with tqdm(total=params.max_tokens, desc="beam search", unit="tok", disable=not use_tqdm) as bar:
            while not search.done:
                batch = search.pending()
                outs = self.generate([{"prompt_token_ids": t} for _, t in batch], step, use_tqdm=False,
                                     lora_request=[loras[i] for i, _ in batch])
                search.advance([candidates(o) for o in outs])
                bar.update(1)
        return search.outputs(eng.tokenizer)

    def score(self, prompts, continuations) -> list[list[float]]:
        """The logprob of each token of each continuation after its prompt: one list per pair, as long as
        the continuation. Prompts as `generate` takes them; continuations as strings (tokenized without
        special tokens) or token-id lists. One dense forward over the whole sequences (`jaxpaged.step.scoring`),
        with the engine's parameters and layer code; the engine's requests and KV pool are untouched."""
        if _is_one_prompt(prompts):
            prompts, continuations = [prompts], [continuations]
        return self._leader().score(list(prompts), list(continuations))

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's pooled final-norm hidden state (`.outputs.embedding`), pooled as
        the engine's `pooler_config` says (LAST / MEAN / CLS; normalized unless `pooling_params.normalize` is
        False). Needs an engine started with `runner="pooling"` or `convert="embed"`. Each prompt is
        computed like a prompt to generate from (chunked prefill, the prefix cache for LAST pooling) and
        finishes after it: no token is generated, no KV block is computed past it."""
        eng = self._leader()
        if not eng.config.pooling:
            raise ValueError("embed needs an engine started with runner='pooling' or convert='embed'")
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                pooling=(pooling_params or PoolingParams()).resolve(eng.config.pooler_config))
        outs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled.tolist()))
                for o in outs]

    def pair_score(self, data_1, data_2, use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for an embedding model, under this name (`LLM.score` is the continuation
        logprobs; docs/research.md): the cosine similarity of the embeddings of each pair (`.outputs.score`).
        `data_1` one prompt (against each of `data_2`) or as many as `data_2` (pairwise)."""
        data_1, data_2 = _prompt_list(data_1), _prompt_list(data_2)
        index = pairs(data_1, data_2)
        embs = self.embed(data_1 + data_2, use_tqdm=use_tqdm)
        a, b = embs[:len(data_1)], embs[len(data_1):]
        return [ScoringRequestOutput(f"score-{k}", a[i].prompt_token_ids + b[j].prompt_token_ids,
                                     ScoringOutput(cosine(a[i].outputs.embedding, b[j].outputs.embedding)))
                for k, (i, j) in enumerate(index)]

    def chat(self, messages_list, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations (lists of {'role', 'content'}) through the chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model directory has none")
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(m)} for m in messages_list]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> dict:
        """Engine counters; with data_parallel_size > 1 the sums, and `replicas`: each replica's."""
        return self._leader().stats()
