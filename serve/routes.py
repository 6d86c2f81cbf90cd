"""The routes: /v1/completions, /v1/chat/completions (plain and streamed), /v1/models, /health, /metrics,
/openapi.json; and their plumbing (auth, body limit, JSON, schema, model name, sampling parameters)."""
from __future__ import annotations

import asyncio
import hmac

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.validation import InvalidParam, check_text
from serve import lora as serve_lora
from serve import outputs as fmt
from serve import prompt_size, tools
from serve.body import read_json
from serve.errors import APIError, from_validation_error, from_value_error
from serve.job import Job, JobStream, run_to_end, sse
from serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from serve.protocol_tools import DeltaFunction, DeltaToolCall


# -- request plumbing ---------------------------------------------------------------------------
async def parse(request: Request, model_cls):
    """Auth, the body (size limit, JSON, nesting depth), schema and model name; any failure is an APIError."""
    st = request.app.state.server
    check_auth(request)
    data = await read_json(request, st.max_body_bytes, st.body_timeout)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    request.state.lora = serve_lora.resolve(st, req.model)  # the adapter `model` names (404 if none)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return req


def check_auth(request: Request) -> None:
    key = request.app.state.server.api_key
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


def sampling_params(req, max_tokens: int | None, logprobs: int | None, rename: dict,
                    structured=None, prompt_logprobs: int | None = None) -> SamplingParams:
    kw = dict(structured_outputs=structured, n=req.n, max_tokens=max_tokens, logprobs=logprobs, stop=req.stop,
              stop_token_ids=req.stop_token_ids,
              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
              prompt_logprobs=prompt_logprobs, return_routed_experts=req.return_routed_experts)
    if req.logit_bias:  # OpenAI's string keys (the schema admits digits only)
        kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
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
async def completions(request: Request) -> Response:
    req: CompletionRequest = await parse(request, CompletionRequest)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of ({req.best_of}) must equal n ({req.n}): best-of-n selection is not "
                            "supported", param="best_of", code="invalid_combination")
    echo_only = req.max_tokens == 0  # the prompt (and its logprobs), nothing generated: run 1 token, drop it
    if echo_only and not req.echo:
        raise APIError(400, "max_tokens 0 needs echo=true (it returns the prompt only)", param="max_tokens")
    if echo_only and req.min_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens (0)", param="min_tokens",
                       code="invalid_combination")
    structured, _, rename = tools.constraint(req)
    k = num_logprobs(request.app.state.server, "logprobs", req.logprobs)
    params = sampling_params(req, 1 if echo_only else req.max_tokens, k, rename, structured,
                             k if req.echo else None)
    p = req.prompt
    prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
    fmt.check_routes_request(req, len(prompts))
    engine = request.app.state.server.engine
    await prompt_size.check_prompts(engine.tokenizer, [x for x in prompts if isinstance(x, str)],
                                    engine.max_model_len)
    job = Job(request, "cmpl", rename)
    await job.start(prompts, params, stream=req.stream)
    text = fmt.TokenText(request.app.state.server.engine.tokenizer)
    st, n = job.st, req.n

    def choice(i, c, text_piece, ids, lps, offset, prompt=None):
        lp = fmt.completion_logprobs(text, ids, lps, k, offset) if k is not None else None
        if lp is not None and prompt is not None:  # echo: the prompt's tokens first
            lp = fmt.echo_logprobs(text, prompt, k, lp)
        return CompletionChoice(index=i * n + c.index, text=text_piece, logprobs=lp, finish_reason=c.finish_reason,
                                routed_experts=fmt.routes(c.routed_experts))

    if not req.stream:
        if not await run_to_end(job):
            return Response(status_code=499)
        if echo_only:
            job.lasts = [fmt.without_generated(o) for o in job.lasts]
        choices = []
        for i, out in enumerate(job.lasts):
            prefix = text.prompt_text(out) if req.echo else ""
            choices += [choice(i, c, prefix + c.text, c.token_ids, c.logprobs, len(prefix),
                               out if req.echo else None) for c in out.outputs]
        job.close(200)
        return JSONResponse(CompletionResponse(id=job.id, created=job.created, model=st.model_name,
                                               choices=choices, usage=job.usage(),
                                               prompt_routed_experts=fmt.routes(job.lasts[0].prompt_routed_experts)
                                               ).model_dump())

    async def events():
        deltas = [[fmt.Delta() for _ in range(n)] for _ in prompts]
        echoed = [[not req.echo] * n for _ in prompts]
        async for i, out in job.outputs():
            if echo_only:
                out = job.lasts[i] = fmt.without_generated(out)
            for c in out.outputs:
                d = deltas[i][c.index]
                got = d.advance(c)
                if got is None:
                    continue
                piece, ids, lps, _ = got
                base = len(text.prompt_text(out)) if req.echo else 0  # offsets count the echoed prompt
                offset, prompt = base + d.text_len - len(piece), None
                if not echoed[i][c.index]:
                    echoed[i][c.index], prompt = True, out
                    piece = text.prompt_text(out) + piece
                ch = choice(i, c, piece, ids, lps, offset, prompt)
                yield sse(CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=[ch]))
        if req.stream_options and req.stream_options.include_usage:
            yield sse(CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=[],
                                          usage=job.usage()))

    return JobStream(job, events())


# -- chat -------------------------------------------------------------------------------------
def chat_prompt(engine, messages, tool_list=None, add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """The conversation's token ids (call in a worker thread: it renders and tokenizes). The rendered text
    is refused from its size before it is tokenized if it cannot fit max_model_len (serve/prompt_size.py)."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions "
                            "with token ids", param="messages")
    msgs, template_tools = tools.render_messages(messages, tool_list, tok.chat_template)
    try:
        text = tok.render_chat_template(msgs, add_generation_prompt, tools=template_tools)
    except Exception as e:  # noqa: BLE001 -- jinja raises its own kinds for a template's refusals
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages",
                       code="chat_template_error") from None
    try:
        check_text("messages", text)  # a lone surrogate the template passed through
    except InvalidParam as e:
        raise APIError(400, str(e), param="messages") from None
    if prompt_size.refused_unseen(tok, text, engine.max_model_len, "messages") is None:
        prompt_size.check_prefix(tok, text, engine.max_model_len, "messages")
    return tok.encode(text, add_special_tokens=add_special_tokens)


async def chat_completions(request: Request) -> Response:
    req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    st = request.app.state.server
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = num_logprobs(st, "top_logprobs", req.top_logprobs or 0) if req.logprobs else None
    rename = {"prompt": "messages", "logprobs": "top_logprobs",
              "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
    structured, mode, rename_so = tools.constraint(req)
    rename.update(rename_so)
    params = sampling_params(req, max_tokens, k, rename, structured)
    fmt.check_routes_request(req, 1)
    use_tools = req.tools if mode is not None else None
    prompt = await asyncio.to_thread(chat_prompt, st.engine, req.messages, use_tools)
    named = req.tool_choice.function.name if mode == "named" else None
    job = Job(request, "chatcmpl", rename)
    await job.start([prompt], params, stream=req.stream)
    text = fmt.TokenText(st.engine.tokenizer)

    def lp(ids, lps):
        return fmt.chat_logprobs(text, ids, lps, k) if k is not None else None

    if not req.stream:
        if not await run_to_end(job):
            return Response(status_code=499)
        choices = []
        for c in job.lasts[0].outputs:
            content, calls = tools.parse(mode, c.text, named) if c.finish_reason != "length" else (c.text, [])
            reason = "tool_calls" if calls and mode != "named" and c.finish_reason == "stop" else c.finish_reason
            choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                                      logprobs=lp(c.token_ids, c.logprobs), finish_reason=reason,
                                      routed_experts=fmt.routes(c.routed_experts)))
        job.close(200)
        return JSONResponse(ChatCompletionResponse(id=job.id, created=job.created, model=st.model_name,
                                                   choices=choices, usage=job.usage(),
                                                   prompt_routed_experts=fmt.routes(job.lasts[0].prompt_routed_experts)
                                                   ).model_dump())

    def chunk(choices, usage=None):
        return sse(ChatCompletionChunk(id=job.id, created=job.created, model=st.model_name, choices=choices,
                                        usage=usage))

    async def events():
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                     for i in range(req.n)])
        deltas = [fmt.Delta() for _ in range(req.n)]
        opened = set()  # choices whose tool call has started (named tool_choice)
        async for _, out in job.outputs():
            for c in out.outputs:
                got = deltas[c.index].advance(c)
                if got is None:
                    continue
                piece, ids, lps, reason = got
                if mode == "named":  # the output is the arguments: stream them as they come
                    call = DeltaToolCall(index=0, function=DeltaFunction(arguments=piece))
                    if c.index not in opened:  # the first piece opens the call
                        opened.add(c.index)
                        call = DeltaToolCall(index=0, id=tools.new_call(named, "").id, type="function",
                                             function=DeltaFunction(name=named, arguments=piece))
                    delta = ChatDelta(tool_calls=[call])
                elif mode is not None:  # "required" / "auto": the calls are known once the text is whole
                    if reason is None:
                        continue
                    content, calls = tools.parse(mode, c.text, None) if reason != "length" else (c.text, [])
                    delta = ChatDelta(content=content, tool_calls=[DeltaToolCall(
                        index=j, id=t.id, type="function", function=DeltaFunction(
                            name=t.function.name, arguments=t.function.arguments)) for j, t in enumerate(calls)]
                        or None)
                    reason = "tool_calls" if calls and reason == "stop" else reason
                    lps = c.logprobs
                    ids = c.token_ids
                else:
                    delta = ChatDelta(content=piece or None)
                yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=lp(ids, lps),
                                             finish_reason=reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], job.usage())

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
