"""/v1/completions with `use_beam_search: true`, as vLLM's: `n` is the beam width, the n best beams of each
prompt are its choices (best first), answered when the search ends (jaxpaged/core/beam_search.py; the
engine side is `AsyncEngine.beam_search`). Used: n, max_tokens, temperature (each step's; default 1 as
vLLM's), ignore_eos, length_penalty, echo, return_token_ids, skip_special_tokens, truncate_prompt_tokens;
like vLLM, the other sampling fields do not apply. Refused (400 invalid_combination, naming the field):
logprobs, prompt_logprobs, return_routed_experts, structured_outputs, max_tokens 0, and n above
max_logprobs / 2 (each step asks for the top 2n logprobs). `stream: true` gets the whole answer as one
chunk per choice, then usage (with stream_options.include_usage) and [DONE] (vLLM ignores stream here).
"""
from __future__ import annotations

import asyncio
import itertools

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from jaxpaged.core.beam_search import BeamSearchParams
from serve.errors import APIError, from_value_error
from serve.job import sse
from serve.prompts import completion_prompts, truncation
from serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage

_ids = itertools.count()


def refuse(req: CompletionRequest, max_logprobs: int) -> None:
    """The fields that do not combine with beam search: a 400 naming the first one."""
    def bad(field, why):
        raise APIError(400, f"{field} {why} with use_beam_search", param=field, code="invalid_combination")
    if 2 * req.n > max_logprobs:
        bad("n", f"(the beam width) must be at most {max_logprobs // 2} (each step asks for the top 2n logprobs; "
                 f"--max-logprobs is {max_logprobs})")
    for field in ("logprobs", "prompt_logprobs", "structured_outputs"):
        if getattr(req, field, None) is not None:
            bad(field, "is not supported")
    if req.return_routed_experts:
        bad("return_routed_experts", "is not supported")
    if req.max_tokens == 0:
        bad("max_tokens", "must be at least 1")


def check_lengths(ids: list[list[int]], max_tokens: int | None, max_model_len: int) -> None:
    """As a request without beam search: a prompt leaves room for one token, and for max_tokens when given."""
    for x in ids:
        if len(x) >= max_model_len:
            raise APIError(400, f"prompt has {len(x)} tokens; max_model_len is {max_model_len} (a prompt must "
                                "leave room for at least one generated token)", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and len(x) + max_tokens > max_model_len:
            raise APIError(400, f"prompt ({len(x)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                                f"({max_model_len})", param="max_tokens", code="context_length_exceeded")


async def completions(request: Request, req: CompletionRequest) -> Response:
    st = request.app.state.server
    refuse(req, st.max_logprobs)
    try:
        params = BeamSearchParams(beam_width=req.n, max_tokens=req.max_tokens or st.engine.max_model_len,
                                  ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                  temperature=1.0 if req.temperature is None else req.temperature)
    except ValueError as e:
        raise from_value_error(e) from None
    p = req.prompt
    prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
    keep, side = truncation(req, st.engine.max_model_len, req.max_tokens)
    prompts = await completion_prompts(st.engine, prompts, keep, side)
    ids = [q["prompt_token_ids"] if isinstance(q, dict) else q for q in prompts]
    check_lengths(ids, req.max_tokens, st.engine.max_model_len)
    rid = f"cmpl-beam-{next(_ids)}"
    search = await _run(request, st.engine.beam_search(rid, ids, params, getattr(request.state, "lora", None)))
    if search is None:
        return Response(status_code=499)
    tok, choices, completion = st.engine.tokenizer, [], 0
    for i, seqs in enumerate(search.best()):
        prefix = "" if not req.echo else (prompts[i].get("prompt") if isinstance(prompts[i], dict) else None) \
            or (tok.decode(ids[i], skip_special_tokens=False) if tok is not None else "")
        for j, s in enumerate(seqs):
            out = search.generated(i, s)
            completion += len(out)
            text = tok.decode(out, skip_special_tokens=req.skip_special_tokens) if tok is not None else ""
            choices.append(CompletionChoice(index=i * req.n + j, text=prefix + text, finish_reason=s.finish_reason,
                                            prompt_token_ids=list(ids[i]) if req.return_token_ids else None,
                                            token_ids=out if req.return_token_ids else None))
    prompt_tokens = sum(len(x) for x in ids)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
    resp = CompletionResponse(id=rid, created=st.created, model=st.model_name, choices=choices, usage=usage)
    if not req.stream:
        return JSONResponse(resp.model_dump())
    with_usage = bool(req.stream_options and req.stream_options.include_usage) or st.force_include_usage

    async def events():
        for c in choices:
            yield sse(CompletionResponse(id=rid, created=st.created, model=st.model_name, choices=[c]))
        if with_usage:
            yield sse(CompletionResponse(id=rid, created=st.created, model=st.model_name, choices=[], usage=usage))
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
