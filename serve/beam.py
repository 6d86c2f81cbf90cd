"""`use_beam_search: true` on /v1/completions and /v1/chat/completions, as vLLM's: `n` is the beam width, the
n best beams of each prompt are its choices (best first), answered when the search ends
(jaxpaged/core/beam_search.py; the engine side is `AsyncEngine.beam_search`). Used: n, max_tokens /
max_completion_tokens, temperature (each step's; default 1 as vLLM's), ignore_eos, length_penalty, echo,
return_token_ids, skip_special_tokens, truncate_prompt_tokens, the chat template's fields and the reasoning
parser; like vLLM, the other sampling fields do not apply. Refused (400 invalid_combination, naming the
field): logprobs / top_logprobs, prompt_logprobs, prompt_embeds, return_routed_experts, structured outputs
(structured_outputs, a non-text response_format), tools, max_tokens 0, and n above max_logprobs / 2 (each step
asks for the top 2n logprobs). `stream: true` gets the whole answer as one chunk per choice, then usage (with
stream_options.include_usage) and [DONE] (vLLM answers a beam search unstreamed whatever `stream` says).
A route's plan without sampling parameters is a search here (`answer`, from serve/generation.py); the route
renders the beams (`beam_answers`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from jaxpaged.core.beam_search import BeamSearchParams
from serve.errors import APIError, from_value_error
from serve.job import sse
from serve.protocol import Usage
from serve.routes import stream_usage

log = logging.getLogger("jaxpaged.serve")
_ids = itertools.count()


def refuse(req, max_logprobs: int) -> None:
    """The fields that do not combine with beam search: a 400 naming the first one."""
    def bad(field, why):
        raise APIError(400, f"{field} {why} with use_beam_search", param=field, code="invalid_combination")
    if 2 * req.n > max_logprobs:
        bad("n", f"(the beam width) must be at most {max_logprobs // 2} (each step asks for the top 2n logprobs; "
                 f"--max-logprobs is {max_logprobs})")
    for field in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_embeds", "structured_outputs", "tools"):
        if getattr(req, field, None) not in (None, False):
            bad(field, "is not supported")
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        bad("response_format", "is not supported")
    if req.return_routed_experts:
        bad("return_routed_experts", "is not supported")
    if req.max_tokens == 0:
        bad("max_tokens", "must be at least 1")


def check_lengths(ids: list[list[int]], max_tokens: int | None, max_model_len: int, names=("prompt", "max_tokens")):
    """As a request without beam search: a prompt leaves room for one token, and for max_tokens when given."""
    for x in ids:
        if len(x) >= max_model_len:
            raise APIError(400, f"prompt has {len(x)} tokens; max_model_len is {max_model_len} (a prompt must "
                                "leave room for at least one generated token)", param=names[0],
                           code="context_length_exceeded")
        if max_tokens is not None and len(x) + max_tokens > max_model_len:
            raise APIError(400, f"prompt ({len(x)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                                f"({max_model_len})", param=names[1], code="context_length_exceeded")


async def search(request: Request, req, ids: list[list[int]], max_tokens: int | None, names=("prompt", "max_tokens")):
    """Run the search over token-id prompts: the finished BeamSearch, or None if the client went away."""
    st = request.app.state.server
    check_lengths(ids, max_tokens, st.engine.max_model_len, names)
    try:
        params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens or st.engine.max_model_len,
                                  ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                  temperature=1.0 if req.temperature is None else req.temperature)
    except ValueError as e:
        raise from_value_error(e) from None
    rid, t0 = f"beam-{next(_ids)}", time.monotonic()
    found = await _run(request, st.engine.beam_search(rid, ids, params, getattr(request.state, "lora", None)))
    _record(st, rid, ids, found, params, time.monotonic() - t0)
    return found


def _record(st, rid: str, ids: list[list[int]], found, params: BeamSearchParams, seconds: float) -> None:
    """The metrics of each prompt (as one request: its beams' tokens, its best beam's finish reason; "abort"
    when the client went away) and one log line, as `serve.job.Job` records other requests."""
    out_tokens, best = 0, found.best() if found is not None else [[] for _ in ids]
    for i, (x, seqs) in enumerate(zip(ids, best)):
        n = sum(len(found.generated(i, s)) for s in seqs)
        out_tokens += n
        st.metrics.observe(len(x), n, seqs[0].finish_reason if seqs else "abort", None, None, seconds,
                           params.beam_width, params.max_tokens)
    log.info("%s %s prompt_tokens=%d output_tokens=%d total=%.3fs beam_width=%d", rid,
             "ok" if found is not None else "disconnected", sum(len(x) for x in ids), out_tokens, seconds,
             params.beam_width)


def usage(ids: list[list[int]], completion: int) -> Usage:
    """A search's usage: its prompts' tokens and `completion` generated tokens (the beams shown)."""
    prompt = sum(len(x) for x in ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def prompt_ids(prompts: list) -> list[list[int]]:
    """The token ids of engine prompts (token-id lists, or dicts beside their text)."""
    return [q["prompt_token_ids"] if isinstance(q, dict) else q for q in prompts]


async def answer(request: Request, req, plan, route) -> Response:
    """A beam search of `plan`'s prompts (serve/generation.py), rendered by `route`: one response, or
    streamed as one chunk per choice, then usage (with stream_options.include_usage) and [DONE]."""
    st = request.app.state.server
    ids = prompt_ids(plan.prompts)
    found = await search(request, req, ids, plan.max_tokens, plan.names)
    if found is None:
        return Response(status_code=499)
    head = dict(id=f"{route.prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=st.model_name)
    response, chunks, usage_chunk = route.beam_answers(st, req, plan, found, head)
    if not req.stream:
        return JSONResponse(response.model_dump())
    with_usage, _ = stream_usage(st, req)

    async def events():
        for c in chunks:
            yield sse(c)
        if with_usage:
            yield sse(usage_chunk)
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def _run(request: Request, coro):
    """The search, or None if the client went away first (its requests are aborted); engine errors as
    APIErrors."""
    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
    if not work.done() or work.cancelled():
        return None
    try:
        return work.result()
    except ValueError as e:
        raise from_value_error(e) from None
    except QueueFullError as e:
        raise APIError(503, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from None
    except RequestFailedError as e:
        raise APIError(500, str(e), code="step_failed") from None
