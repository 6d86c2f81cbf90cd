"""The routes: /v1/completions (plain and streamed; chat in serve/chat.py), /v1/models, /health, /metrics,
/openapi.json; and their plumbing (auth, body limit, JSON, schema, model name, sampling parameters)."""
from __future__ import annotations

import hmac

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.sampling_params import SamplingParams
from serve import beam, tools
from serve import lora as serve_lora
from serve import outputs as fmt
from serve.body import read_json
from serve.errors import APIError, from_validation_error, from_value_error
from serve.job import Job, JobStream, run_to_end, sse
from serve.prompts import completion_prompts, embeds_prompts, truncation
from serve.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)


# -- request plumbing ---------------------------------------------------------------------------
async def validated(request: Request, choose):
    """Auth, the body (size limit, JSON, nesting depth) and its schema: the request model `choose(data)`
    validated from it; any failure is an APIError."""
    st = request.app.state.server
    check_auth(request)
    data = getattr(request.state, "body", None)  # read already by /invocations
    if data is None:
        data = await read_json(request, st.config.max_body_bytes, st.config.request_body_timeout)
    try:
        return choose(data).model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def parse(request: Request, model_cls):
    """`validated`, then the model name and the stream options; any failure is an APIError."""
    st = request.app.state.server
    req = await validated(request, lambda data: model_cls)
    request.state.lora = serve_lora.resolve(st, req.model)  # the adapter `model` names (404 if none)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs",
                       code="invalid_combination")
    return req


def stream_usage(st, req) -> tuple[bool, bool]:
    """(usage in a last chunk, usage so far on every chunk) of a stream: stream_options.include_usage (or
    --enable-force-include-usage) and, with it, stream_options.continuous_usage_stats, as vLLM's."""
    so = req.stream_options
    include = bool(so and so.include_usage) or st.config.enable_force_include_usage
    return include, include and bool(so and so.continuous_usage_stats)


def token_text(st, req) -> fmt.TokenText:
    """Token ids -> logprobs' token strings: 'token_id:N' with return_tokens_as_token_ids (default: the
    server's --return-tokens-as-token-ids)."""
    as_ids = req.return_tokens_as_token_ids
    return fmt.TokenText(st.engine.tokenizer, st.config.return_tokens_as_token_ids if as_ids is None else as_ids)


def check_auth(request: Request) -> None:
    key = request.app.state.server.config.api_key
    if key is None:
        return
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")


def num_logprobs(st, field: str, k: int | None) -> int | None:
    """The logprobs per token a request asks (`field`: logprobs / top_logprobs): -1 is the whole vocabulary,
    capped by --max-logprobs (as vLLM's); more than that cap is a 400 naming the field and the cap."""
    if k == -1:
        return st.max_logprobs
    if k is not None and k > st.max_logprobs:
        raise APIError(400, f"{field} ({k}) is greater than max_logprobs ({st.max_logprobs}): the server's "
                            "--max-logprobs, capped by the vocabulary size", param=field)
    return k


def shown_logprobs(req, k: int | None) -> int | None:
    """The logprobs each generated token shows: the top `k` (None: none), or with logprob_token_ids (which
    need logprobs asked, as vLLM's) the sampled token's and the ids' (fmt.ALL)."""
    if not req.logprob_token_ids:
        return k
    if k is None:
        raise APIError(400, "logprob_token_ids need logprobs (chat: logprobs true)", param="logprob_token_ids",
                       code="invalid_combination")
    return fmt.ALL


def sampling_params(req, max_tokens: int | None, logprobs: int | None, rename: dict,
                    structured=None, prompt_logprobs: int | None = None) -> SamplingParams:
    kw = dict(structured_outputs=structured, n=req.n, max_tokens=max_tokens, logprobs=logprobs, stop=req.stop,
              stop_token_ids=req.stop_token_ids,
              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
              prompt_logprobs=prompt_logprobs, return_routed_experts=req.return_routed_experts)
    if req.logit_bias:  # OpenAI's string keys (the schema admits digits only)
        kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if req.allowed_token_ids:
        kw["allowed_token_ids"] = req.allowed_token_ids
    if req.logprob_token_ids:
        kw["logprob_token_ids"] = req.logprob_token_ids
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.seed is not None:
        kw["seed"] = req.seed
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise from_value_error(e, rename) from None


# -- completions ------------------------------------------------------------------------------
def check_embeds(req: CompletionRequest, embeds: list, prompt_logprobs: int | None) -> None:
    """A prompt or prompt_embeds (as vLLM's); embeddings have no tokens to echo or give logprobs of."""
    if req.prompt is None and not embeds:
        raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt",
                       code="empty_prompt")
    if embeds and (req.echo or prompt_logprobs is not None):
        raise APIError(400, f"prompt_embeds: {'echo' if req.echo else 'prompt_logprobs'} is not available for "
                       "prompts given as embeddings (they have no token ids)", param="prompt_embeds",
                       code="invalid_combination")


async def completions(request: Request) -> Response:
    req: CompletionRequest = await parse(request, CompletionRequest)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of ({req.best_of}) must equal n ({req.n}): best-of-n selection is not "
                            "supported", param="best_of", code="invalid_combination")
    if req.use_beam_search:
        return await beam.completions(request, req)
    echo_only = req.max_tokens == 0  # the prompt (and its logprobs), nothing generated: run 1 token, drop it
    if echo_only and not req.echo:
        raise APIError(400, "max_tokens 0 needs echo=true (it returns the prompt only)", param="max_tokens")
    if echo_only and req.min_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens (0)", param="min_tokens",
                       code="invalid_combination")
    st = request.app.state.server
    structured, _, rename = await tools.constraint(req, st.engine, st.config.max_grammar_bytes)
    k = num_logprobs(st, "logprobs", req.logprobs)
    shown = shown_logprobs(req, k)  # of the generated tokens (echo: the prompt's show the top k)
    pl = num_logprobs(st, "prompt_logprobs", req.prompt_logprobs)  # the response's prompt_logprobs
    engine_pl = max((x for x in (pl, k if req.echo else None) if x is not None), default=None)
    params = sampling_params(req, 1 if echo_only else req.max_tokens, k, rename, structured, engine_pl)
    p, e = req.prompt, req.prompt_embeds
    prompts = [] if p is None else [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
    embeds = [] if e is None else [e] if isinstance(e, str) else list(e)
    check_embeds(req, embeds, pl)
    fmt.check_routes_request(req, len(embeds) + len(prompts))
    keep, side = truncation(req, st.engine.max_model_len, params.max_tokens)
    # as vLLM's: the embeddings' prompts (and choices) first
    prompts = await embeds_prompts(st.engine, embeds, keep, side) + await completion_prompts(st.engine, prompts,
                                                                                             keep, side)
    job = Job(request, "cmpl", rename)
    await job.start(prompts, params, stream=req.stream)
    text, n, ids_out = token_text(st, req), req.n, bool(req.return_token_ids)
    last_usage, every_usage = stream_usage(st, req)

    def choice(i, c, text_piece, ids, lps, offset, prompt=None, out=None):
        lp = fmt.completion_logprobs(text, ids, lps, shown, offset) if k is not None else None
        if lp is not None and prompt is not None:  # echo: the prompt's tokens first
            lp = fmt.echo_logprobs(text, prompt, k, lp)
        return CompletionChoice(index=i * n + c.index, text=text_piece, logprobs=lp, finish_reason=c.finish_reason,
                                routed_experts=fmt.routes(c.routed_experts),
                                prompt_logprobs=fmt.prompt_logprobs(text, out, pl) if out is not None else None,
                                prompt_token_ids=list(out.prompt_token_ids) if ids_out and out is not None else None,
                                token_ids=list(ids) if ids_out else None)

    if not req.stream:
        if not await run_to_end(job):
            return Response(status_code=499)
        if echo_only:
            job.lasts = [fmt.without_generated(o) for o in job.lasts]
        choices = []
        for i, out in enumerate(job.lasts):
            prefix = text.prompt_text(out) if req.echo else ""
            choices += [choice(i, c, prefix + c.text, c.token_ids, c.logprobs, len(prefix),
                               out if req.echo else None, out) for c in out.outputs]
        job.close(200)
        return JSONResponse(CompletionResponse(id=job.id, created=job.created, model=st.model_name,
                                               choices=choices, usage=job.usage(),
                                               prompt_routed_experts=fmt.routes(job.lasts[0].prompt_routed_experts)
                                               ).model_dump())

    async def events():
        deltas = [[fmt.Delta() for _ in range(n)] for _ in prompts]
        echoed = [[not req.echo] * n for _ in prompts]
        started = [[False] * n for _ in prompts]  # return_token_ids: the prompt's ids go in the first chunk
        async for i, out in job.outputs():
            if echo_only:
                out = job.lasts[i] = fmt.without_generated(out)
            for c in out.outputs:
                d = deltas[i][c.index]
                got = d.advance(c)
                if got is None:
                    continue
                piece, ids, lps, _ = got
                base = len(text.prompt_text(out)) if req.echo else 0  # offsets count the echo
                offset, prompt = base + d.text_len - len(piece), None
                if not echoed[i][c.index]:
                    echoed[i][c.index], prompt = True, out
                    piece = text.prompt_text(out) + piece
                ch = choice(i, c, piece, ids, lps, offset, prompt)
                if ids_out and not started[i][c.index]:
                    started[i][c.index], ch.prompt_token_ids = True, list(out.prompt_token_ids)
                yield sse(CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=[ch],
                                             usage=job.usage() if every_usage else None))
        if last_usage:
            yield sse(CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=[],
                                          usage=job.usage()))

    return JobStream(job, events())


# -- the rest ---------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    check_auth(request)
    st = request.app.state.server
    card = ModelCard(id=st.model_name, created=st.created, max_model_len=st.engine.max_model_len,
                     root=st.model_root)
    adapters = [ModelCard(id=name, created=st.created, max_model_len=st.engine.max_model_len, root=lr.lora_path,
                          parent=st.model_name) for name, lr in (st.adapters.by_name.items() if st.adapters else ())]
    return JSONResponse(ModelList(data=[card] + adapters).model_dump())  # the base model's parent: null


async def load_lora_adapter(request: Request) -> Response:
    check_auth(request)
    return await serve_lora.load(request)


async def unload_lora_adapter(request: Request) -> Response:
    check_auth(request)
    return await serve_lora.unload(request)


async def health(request: Request) -> Response:
    if request.app.state.server.engine.is_alive():
        return Response(status_code=200)
    raise APIError(503, "the engine loop is not running", code="engine_unavailable")


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.server.metrics.render()
    return Response(body, media_type=content_type)


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.server.openapi)
