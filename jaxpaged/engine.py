"""LLMEngine: add_request / step / abort_request (LLM, the offline front, is in jaxpaged/llm.py).

`step()` reads as three calls: the scheduler decides, the runner computes, the scheduler updates;
then the engine applies stop conditions and builds outputs.
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.core.logit_controls import bad_words_token_ids
from jaxpaged.parallel.mesh import kv_head_replication, make_mesh
from jaxpaged.core.outputs import CompletionOutput, RequestOutput
from jaxpaged.pause import is_draining, pause, paused_step
from jaxpaged.step.research import check_layers, check_params, completion_hidden
from jaxpaged.step import routed_experts
from jaxpaged.core.request import ListPrefix, Request, RequestStatus
from jaxpaged.step.runner import NUM_BANNED, ModelRunner, kv_bytes_per_block
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.structured import StructuredOutputs
from jaxpaged.core.tokenizer import IncrementalDetokenizer, Tokenizer, generation_eos_ids
from jaxpaged.core.validation import InvalidParam, check_request, prompt_ids
from jaxpaged.checkpoints.weights import count_tensors, load_params, release_host_memory
from jaxpaged.spec_decode.config import check_request as check_speculative
from jaxpaged.spec_decode.decoder import SpecDecoder
from jaxpaged.spec_decode.draft import check_draft

log = logging.getLogger("jaxpaged.engine")


class FatalStepError(RuntimeError):
    """A step failure that no retry can mend (e.g. a lost multi-host follower): the engine is down."""


@dataclass(eq=False)
class _Group:
    """One user request: its n samples and their detokenizers."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival: float
    stream: bool = True                # an output every step it advances (else only the final one)
    finished_time: float | None = None

    def __post_init__(self):
        # detokenize every step (streamed text, stop strings), or only when the final output is built
        self.text_each_step = self.stream or bool(self.samples[0].params.stop)


def _freeze_startup_heap() -> None:
    """Move every object alive now (modules, tokenizer, compiled steps: ~140k with the default model) out
    of the collector's reach, as vLLM does after start-up. Otherwise each full collection walks them all:
    ~70 ms every few hundred steps when outputs stream at 256 running (0.35 ms a step on average, and a
    stall in the stream). Garbage is collected first, so only live objects are frozen; the engine holds
    no reference cycles, so dropping it still frees its weights and pool. Once a process: later engines
    (tests, benchmarks) would freeze their predecessors' short-lived objects too, and those, if they
    later became cyclic garbage, would never be collected."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def _completion(r: Request, detok: IncrementalDetokenizer, final: bool) -> CompletionOutput:
    """One sample's part of its group's output; its token ids and logprobs are copied only when read.
    final (finished without error): with its hidden states and routed experts, when asked."""
    return CompletionOutput(r.index, detok.visible_text(r.status is RequestStatus.FINISHED),
                            ListPrefix(r.token_ids, len(r.prompt_token_ids), len(r.token_ids)),
                            ListPrefix(r.logprobs, 0, len(r.logprobs)) if r.logprobs is not None else None,
                            r.finish_reason, completion_hidden(r) if final else None,
                            routed_experts.completion_routes(r) if final else None)


def _drop_finished(out):
    """Take requests finished since scheduling (stopped one step late, aborted) out of a SchedulerOutput."""
    out.scheduled = [(r, n) for r, n in out.scheduled if not r.is_finished]
    out.num_tokens = sum(n for _, n in out.scheduled)
    return out


class LLMEngine:
    def __init__(self, config: EngineConfig, devices: list | None = None):
        """Load the model onto a mesh of the first config.tensor_parallel_size of `devices`
        (default: jax.devices()) and compile every step shape."""
        self.config = cfg = config
        model_dir = cfg.model
        if model_dir is None:
            from jaxpaged.checkpoints.default_model import default_model_dir
            model_dir = default_model_dir()
        if not os.path.isdir(model_dir):
            raise ValueError(f"model directory {model_dir!r} does not exist")
        self.model_dir = model_dir
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        if cfg.speculative_config is not None and cfg.speculative_config.method == "draft_model":
            check_draft(cfg.speculative_config.model, mc)  # a bad draft fails before the target loads
        self.mesh = make_mesh(cfg.tensor_parallel_size, devices)
        kv_head_replication(mc, cfg.tensor_parallel_size)  # a bad size fails before the weights load
        cfg.hidden_state_layers = list(check_layers("hidden_state_layers", cfg.hidden_state_layers,
                                                    mc.num_layers, mc.num_layers)) or None
        cfg.steering_layers = list(check_layers("steering_layers", cfg.steering_layers,
                                                mc.num_layers, mc.num_layers - 1)) or None
        limit = mc.max_position_embeddings
        self.max_model_len = cfg.max_model_len or min(limit, 4096)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({limit})")
        self.tokenizer = Tokenizer.from_dir(model_dir)
        eos = set(mc.eos_token_ids) | generation_eos_ids(model_dir)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        with tqdm(total=count_tensors(mc), desc="loading weights", unit="tensor",
                  disable=not cfg.show_progress) as bar:
            params = load_params(model_dir, mc, cfg.dtype, progress=bar, quantization=cfg.quantization)
        self.load_seconds = time.perf_counter() - t0

        self.num_blocks = self._num_blocks()
        self.structured = StructuredOutputs(
            os.path.join(model_dir, "tokenizer.json") if self.tokenizer is not None else None, mc.vocab_size,
            cfg.max_num_seqs, self.eos_token_ids)
        self.runner = ModelRunner(mc, cfg, params, self.num_blocks, self.max_model_len, mesh=self.mesh,
                                  structured=self.structured)
        del params
        release_host_memory()
        if cfg.warmup:
            self.runner.warmup(cfg.show_progress)
        # every layer sliding (Mistral): blocks behind the window are freed while a request runs
        window = mc.sliding_window if mc.all_layers_windowed else None
        self.block_manager = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          sliding_window=window)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.max_loras if cfg.enable_lora else None)
        self.groups: dict[str, _Group] = {}
        self._rng = np.random.default_rng(cfg.seed)
        self._ids = itertools.count()
        self.num_step_failures = 0              # since start
        self.num_consecutive_step_failures = 0  # since the last step that succeeded
        # a multi-host leader hands each step's host inputs to its followers: it keeps the synchronous path
        self.async_scheduling = cfg.async_scheduling and not self.mesh.is_multi_process
        self._inflight = None                   # async scheduling: the step started, not read back yet
        self.pause_state = None                 # pause_generation's (jaxpaged/pause.py)
        self.sleep_level = 0                    # sleep's: 0 awake, 1 or 2 (jaxpaged/sleep.py)
        self._host_params = None                # asleep at level 1: the parameters in host memory
        spec = cfg.speculative_config
        self.spec = SpecDecoder(spec, self.max_model_len, self.runner) if spec is not None else None  # speculative
        _freeze_startup_heap()

    def _num_blocks(self) -> int:
        cfg, per_seq = self.config, -(-self.max_model_len // self.config.block_size)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, cfg.block_size, cfg.dtype, cfg.tensor_parallel_size,
                                       cfg.kv_cache_dtype)
        n = int(cfg.kv_cache_memory_gb * 2 ** 30) // per_block
        if n < per_seq + 1:
            raise ValueError(f"kv_cache_memory_gb={cfg.kv_cache_memory_gb} holds {n} blocks, fewer than one "
                             f"max_model_len ({self.max_model_len}) request needs ({per_seq}); raise it")
        return min(n, cfg.max_num_seqs * per_seq + 1)

    # -- requests -------------------------------------------------------------------------
    def request_limits(self) -> dict:
        """The model-dependent bounds `add_request` enforces (the server states them in its schema)."""
        return dict(vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                    max_logprobs=self.runner.num_logprobs, max_banned_ids=NUM_BANNED,
                    num_eos_ids=len(self.eos_token_ids))

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True, lora_request=None) -> str:
        """Queue a request; raise ValueError (nothing queued) if it is invalid. Returns its id.

        Everything the step will use is checked here (SamplingParams, then `validation.check_request`
        against the model), so a request that is accepted cannot make a step fail. stream=False: `step`
        returns only the request's final output, and its intermediate outputs and text are never built
        (what `LLM.generate` wants; the final output is the same). `lora_request`: a LoRARequest the
        request runs with (registered and loaded now when new: `add_lora`)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: fields may have been changed since creation
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_ids(prompt, self.tokenizer, self.model_dir)
        lora_int_id = self._lora_id(lora_request)
        self.structured.check(params)
        if self.spec is not None:
            check_speculative(params)
        check_params(params, tuple(self.config.hidden_state_layers or ()), tuple(self.config.steering_layers or ()),
                     self.model_config.hidden_size)
        routed_experts.check_params(params, self.model_config)
        if params.bad_words and self.tokenizer is None:
            raise InvalidParam("bad_words", f"bad_words need a tokenizer; {self.model_dir} has none")
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else []
        budget = self.config.max_num_batched_tokens
        max_tokens = check_request(ids, params, self.request_limits(),
                                   lambda n: self.block_manager.max_blocks_held(n, budget), self.num_blocks - 1)
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        base_seed = int(self._rng.integers(2 ** 32)) if params.seed is None else params.seed % 2 ** 32
        now = time.monotonic() if arrival_time is None else arrival_time
        samples, detoks = [], []
        for i in range(params.n):
            req = Request(request_id=request_id if params.n == 1 else f"{request_id}#{i}", group_id=request_id,
                          index=i, prompt_token_ids=ids, params=params,
                          seed=(base_seed + i * 0x9E3779B9) % 2 ** 32, eos_token_ids=self.eos_token_ids,
                          arrival=now, sibling=samples[0] if samples else None, bad_words_token_ids=bad_words,
                          lora_int_id=lora_int_id)
            samples.append(req)
            detoks.append(IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens))
        self.groups[request_id] = _Group(request_id, text, ids, samples, detoks, now, bool(stream))
        for req in samples:
            self.runner.track(req)
            self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Finish the request now and free its blocks (a no-op for unknown or finished ids)."""
        group = self.groups.pop(str(request_id), None)
        if group is not None:
            for req in group.samples:
                self.scheduler.abort(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def can_step(self) -> bool:
        """Whether `step` would compute anything: unfinished requests, not asleep, not paused (or draining)."""
        return (self.has_unfinished_requests() and not self.sleep_level
                and (self.pause_state is None or self._inflight is not None or is_draining(self)))

    # -- RL controls (docs/research.md) -----------------------------------------------------
    def pause_generation(self, mode: str = "abort", wait: bool = True) -> list[RequestOutput]:
        """Pause: "abort" | "wait" | "keep" (jaxpaged/pause.py); returns the outputs the pause produced."""
        return pause(self, mode, wait)

    def resume_generation(self) -> None:
        """Undo pause_generation: waiting and kept requests are scheduled again."""
        self.pause_state = None

    @property
    def is_paused(self) -> bool:
        return self.pause_state is not None

    def sleep(self, level: int = 1) -> dict:
        """Release device memory (jaxpaged/sleep.py); returns device bytes before and after."""
        from jaxpaged.sleep import sleep
        return sleep(self, level)

    def wake_up(self, reload: bool = False) -> dict:
        """Undo sleep, without recompiling (jaxpaged/sleep.py); returns device bytes before and after."""
        from jaxpaged.sleep import wake_up
        return wake_up(self, reload)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every running request by one scheduled chunk; return outputs of those that changed.

        With async scheduling the step just scheduled starts on the device before the previous one is
        read back; the outputs returned are the previous step's (see docs/architecture.md). Paused
        (pause_generation), only what the pause's mode lets run runs; asleep, it raises RuntimeError."""
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): call wake_up() first")
        if self.pause_state is not None:
            return paused_step(self)
        return self._step()

    def _step(self) -> list[RequestOutput]:
        if self.spec is not None:  # proposals first: the scheduler schedules them (jaxpaged/spec_decode/)
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.spec is not None:  # a draft model proposes now, into the scheduled placeholders
            self.spec.fill(out)
        if self.async_scheduling:
            return self._step_async(out)
        if out.is_empty:
            return []
        try:
            sampled = self.runner.execute(out)
        except FatalStepError:  # the engine cannot step at all (a multi-host follower is lost)
            raise
        except Exception as e:  # noqa: BLE001 -- the step's requests fail; the engine carries on
            return self._step_failed(out, e)
        self.num_consecutive_step_failures = 0
        if self.spec is None:
            return self._process(self.scheduler.update_from_output(out, sampled))
        sampled, new = self.spec.accept(out, sampled)  # accepted proposals appended; the schedule says so
        got = self.scheduler.update_from_output(out, sampled)
        self.spec.rollback(out, self.block_manager)
        return self._process(got, new)

    def _step_async(self, out) -> list[RequestOutput]:
        """Start step t+1, then read back step t (its tokens already fed to t+1 on the device)."""
        prev, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        if prev is not None and (out.is_empty or any(r.needs_last_token and r in prev.pending
                                                      for r, _ in out.scheduled)):
            outputs, prev = self._complete(prev), None  # penalties, grammars need the token on the host first
            _drop_finished(out)
        if not out.is_empty:
            try:
                self._inflight = self.runner.launch(out, prev, prev.pending if prev is not None else ())
            except Exception as e:  # noqa: BLE001 -- as in the synchronous step
                if prev is not None:
                    outputs += self._complete(prev)
                _drop_finished(out)
                return outputs + (self._step_failed(out, e) if not out.is_empty else [])
        if prev is not None:
            outputs += self._complete(prev)
        if self._inflight is not None:  # computed counts advance now; the new tokens are placeholders
            self._inflight.pending = frozenset(self.scheduler.update_from_output(self._inflight.out, None))
        return outputs

    def _complete(self, step) -> list[RequestOutput]:
        """Read a launched step back: fill its placeholder tokens, then stop checks and outputs. A request
        finished meanwhile (stopped one step earlier, aborted) drops its token."""
        try:
            sampled = self.runner.read(step)
        except Exception as e:  # noqa: BLE001 -- the step failed on the device: so did any started after it
            self._inflight = None  # its requests were not advanced: they run again
            return self._step_failed(_drop_finished(step.out), e)
        self.num_consecutive_step_failures = 0
        got = []
        for req, slot, i in step.out.placeholders:
            if not req.is_finished:
                tok, lp = sampled[slot]
                req.token_ids[i] = tok
                if req.logprobs is not None:
                    req.logprobs.append(lp)
                got.append(req)
        return self._process(got)

    def _process(self, got: list[Request], new: dict | None = None) -> list[RequestOutput]:
        """Stop checks and the outputs of the groups that changed (streamed ones) or finished.

        Only requests that stream or have stop strings are detokenized here; the others when their final
        output is built. new: request -> tokens it got this step, when more than one (speculative decoding;
        default one each)."""
        now, groups, outputs = time.monotonic(), self.groups, []
        touched: dict[str, _Group] = {}  # groups of n > 1 samples: one output for all that advanced
        for req in got:
            group = groups[req.group_id]
            if req.first_token_time is None:
                req.first_token_time = now
            if new is not None and new[req] > 1:
                reason = self._check_stop_each(req, group, new[req])
            else:
                stop_string = group.text_each_step and group.detoks[req.index].catch_up(req.token_ids)
                reason = self._check_stop(req, stop_string)
            if reason:
                self.scheduler.finish(req, reason)
            if len(group.samples) == 1:  # the usual case: its output now, no second pass
                self._group_output(group, bool(reason), now, outputs)
            elif reason or group.stream:
                touched[req.group_id] = group
        for group in touched.values():
            self._group_output(group, all([r.status is RequestStatus.FINISHED for r in group.samples]), now,
                               outputs)
        return outputs

    def _group_output(self, group: _Group, finished: bool, now: float, outputs: list) -> None:
        """Append the group's output if it finished (and forget the group) or if it streams."""
        if finished:
            group.finished_time = now
            del self.groups[group.request_id]
        if finished or group.stream:
            outputs.append(self._output(group, finished))

    def _step_failed(self, out, error: Exception) -> list[RequestOutput]:
        """The runner raised: the step's requests (whole groups) finish with "error", the rest go on.

        A failed device call may have consumed the donated KV pool; it is then rebuilt (zeros), every
        running request is recomputed from scratch (as after preemption) and the prefix cache dropped."""
        error_id = uuid.uuid4().hex[:12]
        self.num_step_failures += 1
        self.num_consecutive_step_failures += 1
        groups = {req.group_id: self.groups[req.group_id] for req, _ in out.scheduled}
        log.error("step failed (error id %s; requests %s): %s: %s", error_id, ", ".join(sorted(groups)),
                  type(error).__name__, error, exc_info=error)
        message = f"the step running this request failed (error id {error_id}): {type(error).__name__}"
        for group in groups.values():
            for req in group.samples:
                self.scheduler.finish(req, "error")
        if self.runner.reset_pools(only_lost=True):  # a failed donated call may have consumed them
            log.warning("the KV pool was lost with the failed step (error id %s): %d running requests "
                        "will be recomputed", error_id, len(self.scheduler.running))
            self.scheduler.recompute_all()
            self.block_manager.reset_prefix_cache()
        now = time.monotonic()
        outputs = []
        for group in groups.values():
            group.finished_time = now
            del self.groups[group.request_id]
            outputs.append(self._output(group, True, message))
        return outputs

    def _check_stop(self, req: Request, stop_string: bool) -> str | None:
        p, tok, length = req.params, req.token_ids[-1], len(req.token_ids)
        num_output = length - len(req.prompt_token_ids)
        if (tok in req.stop_ids or stop_string) and num_output >= p.min_tokens:
            return "stop"
        if p.structured_outputs is not None and self.structured.is_complete(req):  # no further token allowed
            return "stop"
        if num_output >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _check_stop_each(self, req: Request, group: _Group, num_new: int) -> str | None:
        """Stop checks after each of the request's `num_new` last tokens, as if they came one step each;
        the tokens (and logprobs) past the first stop are dropped (an accepted run never overshoots)."""
        tail, req.token_ids[-num_new:] = req.token_ids[-num_new:], []
        lps = None
        if req.logprobs is not None:
            lps, req.logprobs[-num_new:] = req.logprobs[-num_new:], []
        for j, tok in enumerate(tail):
            req.token_ids.append(tok)
            if lps is not None:
                req.logprobs.append(lps[j])
            reason = self._check_stop(req, group.text_each_step and group.detoks[req.index].catch_up(req.token_ids))
            if reason:
                return reason
        return None

    def _output(self, group: _Group, finished: bool, error: str | None = None) -> RequestOutput:
        """The group's cumulative output (the text of one detokenized only now caught up first)."""
        samples, detoks = group.samples, group.detoks
        if not group.text_each_step:
            for r, d in zip(samples, detoks):
                d.catch_up(r.token_ids)
        final = finished and error is None
        outs = [_completion(r, d, final) for r, d in zip(samples, detoks)]
        r = samples[0]
        if len(samples) == 1:
            first = r.first_token_time
        else:
            first = min([r.first_token_time for r in samples if r.first_token_time is not None], default=None)
        plp = r.prompt_logprobs
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                             r.num_cached_tokens,
                             dict(arrival_time=group.arrival, first_token_time=first, finished_time=group.finished_time),
                             error, r.prompt_hidden_states if finished else None,
                             prompt_logprobs=list(plp) if plp is not None else None,
                             prompt_routed_experts=routed_experts.prompt_routes(r) if final else None)

    # -- LoRA adapters (jaxpaged/lora/) ---------------------------------------------------------
    def _lora_slots(self):
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self.runner.lora

    def _lora_id(self, lora_request) -> int:
        if lora_request is None:
            return 0
        self.add_lora(lora_request)
        return lora_request.lora_int_id

    def add_lora(self, lora_request) -> bool:
        """Register and load a LoRARequest's PEFT adapter (checked now: ValueError naming what is wrong);
        False if it is registered already."""
        return self._lora_slots().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if unknown. ValueError while unfinished requests use it."""
        users = [r for r in self.scheduler.running + list(self.scheduler.waiting) if r.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"lora_int_id {lora_int_id} is used by {len(users)} unfinished requests")
        removed = self._lora_slots().remove(lora_int_id)
        if removed:  # the id may come back with other weights: no block of this one may serve it
            self.block_manager.reset_prefix_cache()
        return removed

    def list_loras(self) -> list[int]:
        """The registered adapters' lora_int_ids."""
        return sorted(self._lora_slots().registered)

    def lora_requests(self) -> list:
        """The registered adapters' LoRARequests (in lora_int_id order)."""
        slots = self._lora_slots()
        return [slots.registered[i] for i in sorted(slots.registered)]

    def update_lora(self, lora_int_id: int, weights) -> None:
        """Replace a registered adapter's A/B in place, without recompiling (see `LoRASlots.update`);
        the prefix cache is flushed. Refused (RuntimeError) while requests are unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("update_lora: requests are unfinished; call it between generate calls")
        self._lora_slots().update(lora_int_id, weights)
        self.block_manager.reset_prefix_cache()

    def get_weights(self) -> dict:
        """The parameter pytree the steps run on (device arrays; layout in jaxpaged/models/llama.py)."""
        return self.runner.params

    def update_weights(self, weights) -> None:
        """Replace parameters between steps, without recompiling: (HF name, array) pairs or (part of) the
        `get_weights` pytree; see jaxpaged/checkpoints/weight_update.py."""
        from jaxpaged.checkpoints.weight_update import update_weights
        update_weights(self, weights)

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        total = self.num_blocks - 1
        return dict(num_preemptions=sch.num_preemptions, num_compilations=self.runner.num_compilations,
                    num_buckets=len(self.runner.variants()), compile_seconds=self.runner.compile_seconds,
                    kv_blocks_total=total, kv_blocks_free=bm.num_free_blocks,
                    kv_cache_usage=bm.num_used_blocks / total, prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
                    num_running=len(sch.running), num_waiting=len(sch.waiting),
                    num_step_failures=self.num_step_failures,
                    load_seconds=self.load_seconds, attention_backend=self.runner.backend,
                    tensor_parallel_size=self.runner.tp, **self.runner.memory_per_device(),
                    **(self.runner.lora.stats() if self.runner.lora is not None else {}),
                    **(self.spec.stats() if self.spec is not None else {}))
