"""One HTTP generation request as a `Job`: an engine request per prompt, their outputs merged; aborted
(blocks freed) if the client goes away; recorded in the metrics and one log line when it ends."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxpaged.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.engine import RequestOutput
from serve import outputs as fmt
from serve.errors import APIError, from_value_error
from serve.protocol import ErrorInfo

log = logging.getLogger("jaxpaged.serve")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Job:
    """The engine requests of one HTTP request (one per prompt), merged, recorded when they end."""

    def __init__(self, request: Request, prefix: str, rename: dict[str, str]):
        self.request, self.st = request, request.app.state.server
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created, self.arrival = int(time.time()), time.monotonic()
        self.rename = rename  # engine param names -> this request's (prompt -> messages, ...)
        self.ids: list[str] = []
        self.streams: list = []
        self.lasts: list[RequestOutput | None] = []
        self.failed: set[int] = set()  # prompts whose engine request a failed step ended
        self.status = "ok"
        self.closed = False
        self.params: SamplingParams | None = None

    async def start(self, prompts: list, params: SamplingParams, stream: bool = True) -> None:
        """Queue every prompt, or none (a bad one is a 400 and nothing runs). A response that is not
        streamed (`stream` False) gets only each request's final output from the engine."""
        ids = [self.id if len(prompts) == 1 else f"{self.id}-{i}" for i in range(len(prompts))]
        try:
            self.streams = await self.st.engine.add_requests(list(zip(ids, prompts)), params, self.arrival, stream,
                                                             getattr(self.request.state, "lora", None))
        except ValueError as e:
            raise from_value_error(e, self.rename) from None
        except QueueFullError as e:
            raise APIError(503, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        self.ids, self.lasts, self.params = ids, [None] * len(ids), params

    def abort(self) -> None:
        for rid, last in zip(self.ids, self.lasts):
            if last is None or not last.finished:
                self.st.engine.abort(rid)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as they come, from every prompt's stream."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 -- EngineDeadError, RequestFailedError; re-raised below
                if isinstance(e, RequestFailedError):
                    self.failed.add(i)
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self.lasts[i] = item
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            self.abort()

    async def collect(self) -> bool:
        """Run to the end; False if the client disconnected first (everything is aborted then)."""
        async def drain():
            async for _ in self.outputs():
                pass
        work, watch = asyncio.create_task(drain()), asyncio.create_task(_disconnected(self.request))
        stop = asyncio.create_task(self.st.stopping.wait())
        try:
            await asyncio.wait({work, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, watch, stop):
                t.cancel()
        if not work.done() and stop.done() and not stop.cancelled():
            self.status = "shutdown"
            raise APIError(503, "the server is shutting down (its --shutdown-timeout expired)",
                           code="server_shutdown")
        if not work.done() or work.cancelled():
            self.status = "disconnected"
            return False
        try:
            work.result()
        except EngineDeadError as e:
            self.status = "engine-error"
            raise APIError(503, str(e), code="engine_unavailable") from None
        except RequestFailedError as e:
            self.status = "step-error"
            raise APIError(500, str(e), code="step_failed") from None
        return True

    def usage(self):
        """The response's usage (prompt_tokens_details with --enable-prompt-tokens-details, else null)."""
        return fmt.usage(self.lasts, self.st.config.enable_prompt_tokens_details)

    def close(self, http_status: int) -> None:
        """Abort what is unfinished, record it all (once)."""
        if self.closed:
            return
        self.closed = True
        self.abort()
        if self.status == "ok" and any(o is None or not o.finished for o in self.lasts):
            self.status = "disconnected"
        self.finish(http_status)

    def finish(self, http_status: int) -> None:
        """Metrics for every engine request and one log line for the HTTP request."""
        now, m = time.monotonic(), self.st.metrics
        ttfts, reasons, n_out = [], set(), 0
        for i, last in enumerate(self.lasts):
            if last is None:
                reason = "error" if i in self.failed else "abort"
                m.observe(0, 0, reason, None, None, now - self.arrival)
                reasons.add(reason)
                continue
            first = last.metrics.get("first_token_time")
            end = last.metrics.get("finished_time") or now
            n = len(last.outputs[0].token_ids)
            reason = (last.outputs[0].finish_reason or "abort") if last.finished else "abort"
            reason = "error" if i in self.failed else reason
            ttft = None if first is None else first - self.arrival
            tpot = (end - first) / (n - 1) if first is not None and n > 1 else None
            out_tokens = sum(len(c.token_ids) for c in last.outputs)
            p = self.params
            max_tokens = None if p is None else p.max_tokens if p.max_tokens is not None else \
                self.st.engine.max_model_len - len(last.prompt_token_ids)
            m.observe(len(last.prompt_token_ids), out_tokens, reason, ttft, tpot, end - self.arrival,
                      p.n if p is not None else 1, max_tokens)
            if reason not in ("abort", "error"):
                m.observe_phases(last.metrics)
            n_out += out_tokens
            reasons.add(reason)
            if ttft is not None:
                ttfts.append(ttft)
        p_tok = sum(len(o.prompt_token_ids) for o in self.lasts if o is not None)
        ttft = f"{min(ttfts):.3f}s" if ttfts else "-"
        log.info("%s %d %s prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish=%s", self.id,
                 http_status, self.status, p_tok, n_out, ttft, now - self.arrival, ",".join(sorted(reasons)))


def sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


async def _stream(job: Job, events) -> AsyncIterator[str]:
    """Server-sent events from `events` (an async iterator of strings), ending in [DONE]; when the server's
    shutdown timeout expires first, in an error event (code `server_shutdown`) and [DONE]."""
    stop, step = asyncio.ensure_future(job.st.stopping.wait()), None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():  # shutting down: the generator is cancelled where it waits, then closed
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                job.status = "shutdown"
                err = ErrorInfo(message="the server is shutting down (its --shutdown-timeout expired)",
                                type="server_error", code="server_shutdown")
                yield f"data: {json.dumps({'error': err.model_dump()})}\n\n"
                break
            try:
                event = step.result()
            except StopAsyncIteration:
                break
            yield event
        yield "data: [DONE]\n\n"
    except (EngineDeadError, RequestFailedError) as e:
        dead = isinstance(e, EngineDeadError)
        job.status = "engine-error" if dead else "step-error"
        err = ErrorInfo(message=str(e), type="server_error", code="engine_unavailable" if dead else "step_failed")
        yield f"data: {json.dumps({'error': err.model_dump()})}\n\n"
    finally:
        stop.cancel()
        if step is not None:
            step.cancel()


class JobStream(StreamingResponse):
    """A streamed response that closes its job however the response ends (even before it starts)."""

    def __init__(self, job: Job, events):
        super().__init__(_stream(job, events), media_type="text/event-stream")
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close(200)


async def run_to_end(job: Job) -> bool:
    """Non-streamed: wait for every output; False (and the job closed) if the client went away."""
    try:
        ok = await job.collect()
    except APIError as e:
        job.close(e.status)
        raise
    except BaseException:
        job.close(500)
        raise
    if not ok:
        job.close(499)
    return ok
