"""AsyncEngine: an engine's loop (any `Engine` of jaxpaged/contract.py) on its own thread, each request's
outputs streamed to asyncio.

JAX blocks the calling thread for the whole step, so the engine gets a thread of its own. Commands
(add, abort) cross to it through one inbox guarded by a condition variable; outputs cross back with
one `call_soon_threadsafe` per step and event loop. The engine is touched only by its thread. With no
request in flight the thread sleeps on the condition variable (no polling), and wakes on a command.

    engine = AsyncEngine(LLMEngine(EngineConfig(model=DIR)), max_waiting=128)
    stream = await engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))  # ValueError: invalid
    async for out in stream:          # cumulative RequestOutputs; the last has out.finished
        print(out.outputs[0].text)
    # or, in one call:  async for out in engine.generate("Hello", params, "r1"): ...

Leaving the iteration early (break + aclose, cancellation) aborts the request and frees its blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jaxpaged.contract import Engine
from jaxpaged.controls.pause import PAUSE_MODES
from jaxpaged.core.beam_search import BeamSearch, BeamSearchParams, candidates, check_beam_search
from jaxpaged.core.outputs import RequestOutput
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.structured import StructuredOutputsParams
from jaxpaged.core.validation import InvalidParam

log = logging.getLogger("jaxpaged.async_engine")

_END = object()  # stream item: the request was aborted; no more outputs


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests already; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or failed with an error)."""


class RequestFailedError(RuntimeError):
    """A step running this request failed; the request was ended (its message carries the error id)."""


@dataclass(eq=False)
class _Stream:
    request_id: str
    num_samples: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | _END | BaseException
    finished: bool = False


class AsyncEngine:
    """Runs `engine` on a background thread; `max_waiting` bounds requests queued for a slot."""

    def __init__(self, engine: Engine, max_waiting: int | None = None, max_step_failures: int = 3):
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting!r}")
        if not isinstance(max_step_failures, int) or max_step_failures < 1:
            raise ValueError(f"max_step_failures must be an integer >= 1, got {max_step_failures!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_step_failures = max_step_failures  # consecutive failed steps that stop the loop
        self._cv = threading.Condition()
        # ("add", streams, prompts, params, arrival, stream, future) | ("abort", id)
        self._inbox: list[tuple] = []
        self._pending = 0                       # samples in the inbox not yet added (guarded by _cv)
        self._stopping = False
        self._error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._paused = False                    # pause_generation called, resume_generation not yet (_cv)
        self._pause_waiters: list = []          # futures of "wait" pauses still draining (engine thread only)
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    # -- read-only facts for the server ---------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def accepts_prompt_embeds(self) -> bool:
        """Whether prompts may come as embeddings (the engine's enable_prompt_embeds)."""
        return self.engine.config.enable_prompt_embeds

    def request_limits(self) -> dict:
        """The model-dependent bounds every request is checked against (see Engine.request_limits)."""
        return self.engine.request_limits()

    def is_alive(self) -> bool:
        """True while the loop thread runs and has neither failed nor been shut down.

        A failed step fails only its own requests; the loop stops after `max_step_failures` failed
        steps in a row (or an error outside the step), and then this is False."""
        return self._thread.is_alive() and self._error is None and not self._stopping

    def stats(self) -> dict:
        """The engine's stats as of its last step; num_waiting includes requests not yet handed over."""
        with self._cv:
            s = dict(self._stats)
            s["num_waiting"] += self._pending
        return s

    # -- requests (call from an asyncio event loop) -----------------------------------------
    async def call(self, fn):
        """Run `fn(engine)` on the engine thread between steps (e.g. `add_lora`); return its result or
        raise its exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self.is_alive():
                raise EngineDeadError("the engine is not running")
            self._inbox.append(("call", fn, fut))
            self._cv.notify()
        return await asyncio.wrap_future(fut)

    def prepare_structured(self, structured_outputs: StructuredOutputsParams) -> None:
        """Compile the grammar matcher of `structured_outputs` off the engine thread: call it in a worker
        thread, never on the event loop, before `add_requests`; raises ValueError for a refused grammar."""
        self.engine.prepare_structured(structured_outputs)

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and return the async iterator of its outputs.

        Raises ValueError (invalid request, nothing queued), QueueFullError, EngineDeadError."""
        streams = await self.add_requests([(request_id, prompt)], params, arrival_time)
        return streams[0]

    async def add_requests(self, requests: list[tuple[str, object]], params: SamplingParams,
                           arrival_time: float | None = None,
                           stream: bool = True, lora_request=None) -> list[AsyncIterator[RequestOutput]]:
        """Queue several (request id, prompt) with the same params (and LoRA adapter), all or none: if one
        is invalid, raise its ValueError and queue nothing. Returns one output iterator per request, in
        order; with `stream` False each iterator yields only the final output (no intermediate ones are built)."""
        loop = asyncio.get_running_loop()
        streams = [_Stream(str(rid), params.n, loop) for rid, _ in requests]
        prompts = [p for _, p in requests]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = params.n * len(streams)
        with self._cv:
            if not self.is_alive():
                raise EngineDeadError("the engine is not running")
            if self.max_waiting is not None:
                slots = self.engine.config.max_num_seqs * self._stats.get("data_parallel_size", 1)
                free_slots = max(0, slots - self._stats["num_running"])
                if self._pending + self._stats["num_waiting"] >= self.max_waiting + free_slots:
                    raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            self._pending += samples
            self._inbox.append(("add", streams, prompts, params, arrival, stream, lora_request, fut))
            self._cv.notify()
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            for stream in streams:
                self.abort(stream.request_id)  # queued after the add: the engine drops them at once
            raise
        return [self._iterate(stream) for stream in streams]

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last one has `finished` set."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    async def beam_search(self, request_id: str, prompts: list[list[int]], params: BeamSearchParams,
                          lora_request=None) -> BeamSearch:
        """vLLM's beam search over token-id prompts (jaxpaged/core/beam_search.py): one engine request per live
        beam and iteration ("<request_id>-<iteration>-<beam>"), all of an iteration queued together. Returns
        the finished search (`best()`, `generated(...)`). Raises as `add_requests` (an invalid prompt: the
        first iteration's ValueError) and RequestFailedError; cancelled, it aborts the iteration's requests."""
        check_beam_search(params, self.engine.config.logprobs_mode, self.request_limits()["max_logprobs"],
                          self.engine.config.enable_prefix_caching)
        search = BeamSearch(prompts, params, self.engine.eos_token_ids, self.max_model_len)
        step, iteration = search.step_params(), 0
        while not search.done:
            batch = search.pending()
            ids = [f"{request_id}-{iteration}-{j}" for j in range(len(batch))]
            streams = await self.add_requests([(rid, {"prompt_token_ids": t}) for rid, (_, t) in zip(ids, batch)],
                                              step, stream=False, lora_request=lora_request)
            try:
                lasts = [([out async for out in s] or [None])[-1] for s in streams]  # None when aborted
            except BaseException:
                for rid in ids:
                    self.abort(rid)
                raise
            search.advance([candidates(o) for o in lasts])
            iteration += 1
        return search

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once); its blocks are freed at the next step boundary."""
        with self._cv:
            self._inbox.append(("abort", str(request_id)))
            self._cv.notify()

    async def _iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty() and isinstance(item, RequestOutput):
                    item = stream.queue.get_nowait()  # outputs are cumulative: skip to the newest
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    # -- RL controls: pause / resume (jaxpaged/controls/pause.py) -------------------------------------
    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause the engine; returns once paused ("wait": once the running requests are done). Requests
        added meanwhile wait for `resume_generation`; "abort" ends the others' streams with
        finish_reason "abort"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self._command("pause", mode)

    async def resume_generation(self) -> None:
        await self._command("resume")

    def is_paused(self) -> bool:
        """Whether the engine is paused (from the call of pause_generation to that of resume_generation)."""
        with self._cv:
            return self._paused

    async def _command(self, *cmd) -> None:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self.is_alive():
                raise EngineDeadError("the engine is not running")
            self._paused = cmd[0] == "pause"
            self._inbox.append((*cmd, fut))
            self._cv.notify()
        await asyncio.wrap_future(fut)

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort every request in flight, stop the loop thread and wait for it."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self.engine.can_step()):
                        self._cv.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    break
                outputs = self.engine.step() if self.engine.can_step() else []
                failures = self.engine.num_consecutive_step_failures
                if failures >= self.max_step_failures:
                    self._publish(outputs)
                    raise EngineDeadError(f"{failures} steps in a row failed")
                stats = self.engine.stats()
                with self._cv:
                    self._stats = stats  # before publishing: a client that sees its end sees its blocks freed
                self._publish(outputs)
                if self._pause_waiters and not self.engine.can_step():  # a "wait" pause has drained
                    for fut in self._pause_waiters:
                        _resolve(fut)
                    self._pause_waiters.clear()
        except BaseException as e:  # noqa: BLE001 -- a failed step ends the loop; streams learn why
            log.exception("engine loop failed")
            self._error = e
            self._fail_all(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        self._fail_all(None)
        with self._cv:
            self._stats = self.engine.stats()

    def _apply(self, commands: list[tuple]) -> None:
        for cmd in commands:
            if cmd[0] == "abort":
                stream = self._streams.pop(cmd[1], None)
                if stream is not None:
                    self.engine.abort_request(cmd[1])
                    _post(stream.loop, stream.queue.put_nowait, _END)
                continue
            if cmd[0] == "call":
                try:
                    cmd[2].set_result(cmd[1](self.engine))
                except Exception as e:  # noqa: BLE001 -- back to the caller
                    cmd[2].set_exception(e)
                continue
            if cmd[0] in ("pause", "resume"):
                self._control(*cmd)
                continue
            _, streams, prompts, params, arrival, stream_outputs, lora, fut = cmd
            samples = params.n * len(streams)
            done = []
            try:
                for i, (stream, prompt) in enumerate(zip(streams, prompts)):
                    self.engine.add_request(stream.request_id, prompt, params, arrival_time=arrival,
                                            stream=stream_outputs,
                                            **({} if lora is None else dict(lora_request=lora)))
                    done.append(stream.request_id)
            except Exception as e:  # noqa: BLE001 -- ValueError for bad input; anything else also goes back
                for request_id in done:  # all or nothing: no step ran since they were added
                    self.engine.abort_request(request_id)
                if len(streams) > 1 and isinstance(e, InvalidParam) and e.param == "prompt":
                    e = InvalidParam("prompt", f"prompt {i}: {e}", e.code)
                self._settle(samples, queued=False)
                _resolve(fut, e)
                continue
            for stream in streams:
                self._streams[stream.request_id] = stream
            self._settle(samples, queued=True)
            _resolve(fut)  # if the caller was cancelled meanwhile, its aborts are already in the inbox

    def _control(self, what: str, *args) -> None:
        """Apply a pause or resume command (the future last in `args`)."""
        *args, fut = args
        if what == "resume":
            self.engine.controls.resume_generation()
            _resolve(fut)
            return
        self._publish(self.engine.controls.pause_generation(args[0], wait=False))
        if self.engine.can_step():  # "wait": resolved by the loop once drained
            self._pause_waiters.append(fut)
        else:
            _resolve(fut)

    def _settle(self, samples: int, queued: bool) -> None:
        """Move `samples` out of the inbox count before the caller learns the outcome, so stats() never
        counts a refused request, nor misses an accepted one, until the next step refreshes them."""
        with self._cv:
            self._pending -= samples
            if queued:
                self._stats = {**self._stats, "num_waiting": self._stats["num_waiting"] + samples}

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            item = out if out.error is None else RequestFailedError(out.error)
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            _post(loop, _deliver, items)

    def _fail_all(self, error: BaseException | None) -> None:
        with self._cv:
            commands, self._inbox = self._inbox, []
            self._pending = 0
        for cmd in commands:
            if cmd[0] != "abort":  # add, pause, resume: their callers wait on a future
                _resolve(cmd[-1], EngineDeadError("the engine stopped"))
        for fut in self._pause_waiters:
            _resolve(fut, EngineDeadError("the engine stopped"))
        self._pause_waiters.clear()
        for stream in self._streams.values():
            item = _END if error is None else error
            _post(stream.loop, stream.queue.put_nowait, item)
        self._streams.clear()


def _deliver(items) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _resolve(fut: concurrent.futures.Future, error: BaseException | None = None) -> None:
    try:
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:  # cancelled by its awaiting task
        pass
