"""LLMEngine: add_request / step / abort_request (LLM, the offline front, is in jaxpaged/llm.py).

`step()` reads as three calls: schedule (proposals, then the scheduler's choice), run (the executor
computes the step and advances its requests) and update (the output processor's stop checks and
outputs). Features enter through seams chosen once at start-up, never as branches in the step: the
speculative proposer (`spec_decode/`, `NoSpeculation` when off), the executor (plain or async
scheduling, `executor.py`), the runner's step features (`step/`). Around the step: admission checks
(`admission.py`), LoRA administration (`lora/manager.py`), the controls facet (`controls/`:
pause, sleep, weights, LoRA; the contract in `contract.py`).
"""
from __future__ import annotations

import gc
import os
import weakref

from jaxpaged import loading
from jaxpaged.admission import Admission
from jaxpaged.checkpoints.weights import release_host_memory
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.contract import ControlsFront
from jaxpaged.controls.facet import Controls
from jaxpaged.controls.pause import PauseControl
from jaxpaged.controls.sleep import SleepControl
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.output_processor import OutputProcessor
from jaxpaged.core.outputs import CompletionOutput, RequestOutput  # noqa: F401 -- re-exported
from jaxpaged.core.scheduler import Scheduler, SchedulerOutput
from jaxpaged.core.structured import StructuredOutputs, StructuredOutputsParams
from jaxpaged.core.tokenizer import Tokenizer
from jaxpaged.executor import FatalStepError, make_executor  # noqa: F401 -- FatalStepError: re-exported
from jaxpaged.lora.manager import LoRAManager
from jaxpaged.spec_decode.decoder import NoSpeculation, SpecDecoder
from jaxpaged.spec_decode.draft import check_draft
from jaxpaged.step.mesh import kv_head_replication, make_mesh
from jaxpaged.step.runner import ModelRunner
from jaxpaged.step.sink import StepSink


def _freeze_startup_heap() -> None:
    """Move every object alive now (modules, tokenizer, compiled steps: ~140k with the default model) out
    of the collector's reach, as vLLM does after start-up. Otherwise each full collection walks them all:
    ~70 ms every few hundred steps when outputs stream at 256 running (0.35 ms a step on average, and a
    stall in the stream). Garbage is collected first, so only live objects are frozen; the engine holds
    no reference cycles, so dropping it still frees its weights and pool. Once a process: later engines
    (tests, benchmarks) would freeze their predecessors' short-lived objects too, and those, if they
    later became cyclic garbage, would never be collected.
    Every part around the step that needs the engine holds it through a weak proxy, for that reason.
    """
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


class LLMEngine(ControlsFront):
    """One engine (the `Engine` of jaxpaged/contract.py); its controls (`controls`: pause, sleep, weights,
    LoRA adapters) read as its own attributes too (`engine.add_lora(...)`)."""

    def __init__(self, config: EngineConfig, devices: list | None = None, params: dict | None = None,
                 step_sink: StepSink | None = None):
        """Load the model onto a mesh of the first config.tensor_parallel_size of `devices`
        (default: jax.devices()) and compile every step shape. `params`: the parameter pytree to start from
        (the layout of jaxpaged/models/llama.py, host or device arrays) instead of the model directory's
        weights (the directory then needs only config.json; e.g. an RL trainer's model, device to device).
        `step_sink`: where each step's host inputs go too (a multi-host leader's, jaxpaged/step/sink.py)."""
        self.config = cfg = config
        self.model_dir = path = loading.model_dir(cfg)
        self.model_config = mc = ModelConfig.from_dir(path)
        spec = cfg.speculative_config
        if spec is not None and spec.method == "draft_model":
            check_draft(spec.model, mc)  # a bad draft fails before the target loads
        self.mesh = make_mesh(cfg.tensor_parallel_size, devices)
        kv_head_replication(mc, cfg.tensor_parallel_size)  # a bad size fails before the weights load
        loading.check_hooks(cfg, mc)
        self.max_model_len = loading.max_model_len(cfg, mc)
        self.tokenizer = Tokenizer.from_dir(path)
        self.eos_token_ids = loading.eos_token_ids(mc, self.tokenizer, path)
        params, self.load_seconds = (params, 0.0) if params is not None else loading.load_weights(path, mc, cfg)
        self.num_blocks = loading.num_kv_blocks(cfg, mc, self.max_model_len)
        self.structured = StructuredOutputs(os.path.join(path, "tokenizer.json") if self.tokenizer else None,
                                            mc.vocab_size, cfg.max_num_seqs, self.eos_token_ids)
        self.runner = ModelRunner(mc, cfg, params, self.num_blocks, self.max_model_len, mesh=self.mesh,
                                  structured=self.structured, step_sink=step_sink)
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
        self.outputs = OutputProcessor(self.structured, self.max_model_len)
        self.spec = (SpecDecoder(spec, self.max_model_len, self.runner) if spec is not None
                     else NoSpeculation())
        # a multi-host leader hands each step's host inputs to its followers: it keeps the plain step
        self.async_scheduling = cfg.async_scheduling and not self.mesh.is_multi_process
        self.executor = make_executor(self.async_scheduling, self.runner, self.scheduler, self.spec, self.outputs)
        me = weakref.proxy(self)  # the parts around the step hold the engine weakly: no reference cycle
        self.admission, self.pause_control, self.sleep_control = Admission(me), PauseControl(me), SleepControl(me)
        self.lora = LoRAManager(self.runner.lora, self.scheduler, self.executor)
        self.controls = Controls(me)
        _freeze_startup_heap()

    @property
    def groups(self) -> dict:
        """The unfinished user requests (`core/output_processor.Group`), by request id."""
        return self.outputs.groups

    # -- requests -------------------------------------------------------------------------
    def request_limits(self) -> dict:
        """The model-dependent bounds `add_request` enforces (the server states them in its schema)."""
        return self.admission.limits()

    def add_request(self, request_id: str | None, prompt, params=None, arrival_time: float | None = None,
                    stream: bool = True, lora_request=None) -> str:
        """Queue a request; raise ValueError (nothing queued) if it is invalid. Returns its id.

        Everything the step will use is checked here (`admission.py`), so a request that is accepted
        cannot make a step fail. stream=False: `step` returns only the request's final output, and its
        intermediate outputs and text are never built (what `LLM.generate` wants; the final output is the
        same). `lora_request`: a LoRARequest the request runs with (registered and loaded now when new)."""
        group = self.admission.group(request_id, prompt, params, arrival_time, stream, lora_request)
        self.outputs.add(group)
        for req in group.samples:
            self.runner.track(req)
            self.scheduler.add(req)
        return group.request_id

    def prepare_structured(self, structured_outputs: StructuredOutputsParams) -> None:
        """Compile the grammar matcher of `structured_outputs` for this model's tokenizer,
        so that `add_request` and the steps only copy it: safe to call from another thread than the one that
        steps (the server calls it in a worker thread). InvalidParam if the grammar or tokenizer is refused."""
        self.structured.prepare(structured_outputs)

    def abort_request(self, request_id: str) -> None:
        """Finish the request now and free its blocks (a no-op for unknown or finished ids)."""
        self.scheduler.finish_all(self.outputs.abort(str(request_id)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.executor.in_flight is not None

    def can_step(self) -> bool:
        """Whether `step` would compute anything: unfinished requests, not asleep, not paused (or draining)."""
        pause = self.pause_control
        return (self.has_unfinished_requests() and not self.sleep_control.level
                and (not pause.is_paused or self.executor.in_flight is not None or pause.is_draining))

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every running request by one scheduled chunk; return outputs of those that changed.

        With async scheduling the step just scheduled starts on the device before the previous one is
        read back; the outputs returned are the previous step's (see docs/architecture.md). Paused
        (pause_generation), only what the pause's mode lets run runs; asleep, it raises RuntimeError."""
        self.sleep_control.check_awake()
        out = self.schedule()
        got = self.executor.run(out)
        return self.update(got)

    def schedule(self) -> SchedulerOutput:
        """The next step's schedule: proposals first (the scheduler schedules them after each request's last
        token), then the scheduler's choice, then a draft model's proposals into the scheduled placeholders."""
        self.spec.propose(self.scheduler.running)
        return self.spec.fill(self.scheduler.schedule())

    def update(self, got: list) -> list[RequestOutput]:
        """After a run: the output processor's stop checks of the requests that got tokens (`got`), the
        finishes they decide applied by the scheduler; returns the outputs built since the last update."""
        outputs, finishes = self.outputs.update(got)
        self.scheduler.finish_all(finishes)
        return outputs

    @property
    def num_step_failures(self) -> int:
        return self.executor.num_step_failures

    @property
    def num_consecutive_step_failures(self) -> int:
        return self.executor.num_consecutive_step_failures

    def score(self, prompts: list, continuations: list) -> list[list[float]]:
        """The logprob of each continuation token after its prompt: one dense forward with the engine's
        parameters (jaxpaged/step/scoring.py); its requests and KV pool are untouched."""
        from jaxpaged.step.scoring import score
        return score(self, prompts, continuations)

    def stats(self) -> dict:
        bm, sch, runner = self.block_manager, self.scheduler, self.runner
        total = self.num_blocks - 1
        return dict(num_preemptions=sch.num_preemptions, num_compilations=runner.num_compilations,
                    num_buckets=len(runner.variants()), compile_seconds=runner.compile_seconds,
                    kv_blocks_total=total, kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
                    kv_cache_usage=bm.num_used_blocks / total, prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
                    prefix_cache_queries=bm.queried_tokens, prefix_cache_hits=bm.hit_tokens,
                    num_running=len(sch.running), num_waiting=len(sch.waiting),
                    num_waiting_deferred=sch.num_deferred(),
                    iteration_tokens=self.outputs.iteration_tokens.snapshot(),
                    num_step_failures=self.num_step_failures, load_seconds=self.load_seconds,
                    attention_backend=runner.backend, kv_cache_dtype=runner.kv_pool_dtype,
                    matmul_backend=runner.matmul_backend,
                    tensor_parallel_size=runner.tp, **runner.memory_per_device(),
                    **self.lora.stats(), **self.spec.stats())
