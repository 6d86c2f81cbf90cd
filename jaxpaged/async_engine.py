"""AsyncEngine: the LLMEngine loop on its own thread, each request's outputs streamed to asyncio.

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

from jaxpaged.engine import LLMEngine, RequestOutput
from jaxpaged.sampling import SamplingParams

log = logging.getLogger("jaxpaged.async_engine")

_END = object()  # stream item: the request was aborted; no more outputs


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests already; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or failed with an error)."""


@dataclass(eq=False)
class _Stream:
    request_id: str
    num_samples: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | _END | BaseException
    finished: bool = False


class AsyncEngine:
    """Runs `engine` on a background thread; `max_waiting` bounds requests queued for a slot."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []           # ("add", stream, prompt, params, arrival, future) | ("abort", id)
        self._pending = 0                       # samples in the inbox not yet added (guarded by _cv)
        self._stopping = False
        self._error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only
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

    def is_alive(self) -> bool:
        """True while the loop thread runs and has neither failed nor been shut down."""
        return self._thread.is_alive() and self._error is None and not self._stopping

    def stats(self) -> dict:
        """The engine's stats as of its last step; num_waiting includes requests not yet handed over."""
        with self._cv:
            s = dict(self._stats)
            s["num_waiting"] += self._pending
        return s

    # -- requests (call from an asyncio event loop) -----------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and return the async iterator of its outputs.

        Raises ValueError (invalid request, nothing queued), QueueFullError, EngineDeadError."""
        stream = _Stream(str(request_id), params.n, asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        with self._cv:
            if not self.is_alive():
                raise EngineDeadError("the engine is not running")
            if self.max_waiting is not None:
                slots = self.engine.config.max_num_seqs * self._stats.get("data_parallel_size", 1)
                free_slots = max(0, slots - self._stats["num_running"])
                if self._pending + self._stats["num_waiting"] >= self.max_waiting + free_slots:
                    raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            self._pending += params.n
            self._inbox.append(("add", stream, prompt, params, arrival, fut))
            self._cv.notify()
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(stream.request_id)  # queued after the add: the engine drops it at once
            raise
        return self._iterate(stream)

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last one has `finished` set."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

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
                    while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                added = self._apply(commands)
                with self._cv:
                    self._pending -= added
                if stopping:
                    break
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                stats = self.engine.stats()
                with self._cv:
                    self._stats = stats  # before publishing: a client that sees its end sees its blocks freed
                self._publish(outputs)
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

    def _apply(self, commands: list[tuple]) -> int:
        added = 0
        for cmd in commands:
            if cmd[0] == "abort":
                stream = self._streams.pop(cmd[1], None)
                if stream is not None:
                    self.engine.abort_request(cmd[1])
                    _post(stream.loop, stream.queue.put_nowait, _END)
                continue
            _, stream, prompt, params, arrival, fut = cmd
            added += stream.num_samples
            try:
                self.engine.add_request(stream.request_id, prompt, params, arrival_time=arrival)
            except Exception as e:  # noqa: BLE001 -- ValueError for bad input; anything else also goes back
                _resolve(fut, e)
                continue
            self._streams[stream.request_id] = stream
            _resolve(fut)  # if the caller was cancelled meanwhile, its abort is already in the inbox
        return added

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            _post(loop, _deliver, items)

    def _fail_all(self, error: BaseException | None) -> None:
        with self._cv:
            commands, self._inbox = self._inbox, []
            self._pending = 0
        for cmd in commands:
            if cmd[0] == "add":
                _resolve(cmd[5], EngineDeadError("the engine stopped"))
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
