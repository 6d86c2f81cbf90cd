"""/v1/chat/completions (plain and streamed): the conversation through the chat template (in a worker thread),
tools and structured outputs, vLLM's echo / add_generation_prompt / continue_final_message and custom roles."""
from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.validation import InvalidParam, check_text
from serve import beam, prompt_size, reasoning, tools
from serve import outputs as fmt
from serve.errors import APIError
from serve.job import Job, JobStream, run_to_end, sse
from serve.prompts import truncate, truncation
from serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    Usage,
)
from serve.protocol_tools import DeltaFunction, DeltaToolCall
from serve.routes import num_logprobs, parse, sampling_params, shown_logprobs, stream_usage, token_text


def chat_prompt(engine, messages, tool_list=None, add_generation_prompt: bool = True,
                add_special_tokens: bool = False, continue_final_message: bool = False,
                check_size: bool = True) -> list[int]:
    """The conversation's token ids (call in a worker thread: it renders and tokenizes). The rendered text
    is refused from its size before it is tokenized if it cannot fit max_model_len (serve/prompt_size.py),
    unless `check_size` is off (the prompt is to be truncated)."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions "
                            "with token ids", param="messages")
    msgs, template_tools = tools.render_messages(messages, tool_list, tok.chat_template)
    try:
        text = tok.render_chat_template(msgs, add_generation_prompt, tools=template_tools,
                                        continue_final_message=continue_final_message)
    except Exception as e:  # noqa: BLE001 -- jinja raises its own kinds for a template's refusals
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages",
                       code="chat_template_error") from None
    try:
        check_text("messages", text)  # a lone surrogate the template passed through
    except InvalidParam as e:
        raise APIError(400, str(e), param="messages") from None
    if check_size and prompt_size.refused_unseen(tok, text, engine.max_model_len, "messages") is None:
        prompt_size.check_prefix(tok, text, engine.max_model_len, "messages")
    return tok.encode(text, add_special_tokens=add_special_tokens)


def echo_text(req: ChatCompletionRequest, messages, role: str) -> str:
    """echo: the last message's content when its role is the answer's (as vLLM's), else ''."""
    last = messages[-1]
    if not req.echo or last.role != role or last.content is None:
        return ""
    return last.content if isinstance(last.content, str) else "\n".join(p.text for p in last.content)


async def chat_params(st, req: ChatCompletionRequest, num_prompts: int = 1):
    """A chat request's checks and engine parameters: (SamplingParams, the logprobs each token shows (top k,
    fmt.ALL with logprob_token_ids) or None, prompt logprobs or None, rename (engine names -> the request's),
    the tool mode, max tokens)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                            "add_generation_prompt false to continue the last message)",
                       param="continue_final_message", code="invalid_combination")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = num_logprobs(st, "top_logprobs", req.top_logprobs or 0) if req.logprobs else None
    shown = shown_logprobs(req, k)
    pl = num_logprobs(st, "prompt_logprobs", req.prompt_logprobs)
    rename = {"prompt": "messages", "logprobs": "top_logprobs",
              "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
    reasoning.check_no_constraint(req, st.reasoning)
    structured, mode, rename_so = await tools.constraint(req, st.engine, st.config.max_grammar_bytes)
    rename.update(rename_so)
    params = sampling_params(req, max_tokens, k, rename, structured, pl)
    fmt.check_routes_request(req, num_prompts)
    return params, shown, pl, rename, mode, max_tokens


def chat_choice(st, c, index: int, mode, named, role: str, echo: str, logprobs, ids_out: bool) -> ChatChoice:
    """A non-streamed choice from a finished output `c`: reasoning split, tool calls parsed, echo first."""
    thought, answer = st.reasoning.split(c.text)
    content, calls = tools.parse(mode, answer, named) if c.finish_reason != "length" and answer is not None \
        else (answer, [])
    reason = "tool_calls" if calls and mode != "named" and c.finish_reason == "stop" else c.finish_reason
    content = echo + content if content is not None else content
    return ChatChoice(index=index, message=AssistantMessage(
        role=role, content=content, tool_calls=calls, reasoning_content=thought, reasoning=thought),
                      logprobs=logprobs, finish_reason=reason, routed_experts=fmt.routes(c.routed_experts),
                      token_ids=list(c.token_ids) if ids_out else None)


async def chat_completions(request: Request) -> Response:
    req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
    st = request.app.state.server
    params, k, pl, rename, mode, max_tokens = await chat_params(st, req)
    use_tools = req.tools if mode is not None else None
    keep, side = truncation(req, st.engine.max_model_len, max_tokens)
    prompt = await asyncio.to_thread(chat_prompt, st.engine, req.messages, use_tools, req.add_generation_prompt,
                                     False, req.continue_final_message, keep is None)
    prompt = truncate(prompt, keep, side)
    named = req.tool_choice.function.name if mode == "named" else None
    role = "assistant" if req.add_generation_prompt else req.messages[-1].role
    echo = echo_text(req, req.messages, role)
    if req.use_beam_search:
        return await beam.chat(request, req, prompt, max_tokens, role, echo)
    job = Job(request, "chatcmpl", rename)
    await job.start([prompt], params, stream=req.stream)
    text, ids_out = token_text(st, req), bool(req.return_token_ids)

    def lp(ids, lps):
        return fmt.chat_logprobs(text, ids, lps, k) if k is not None else None

    if not req.stream:
        if not await run_to_end(job):
            return Response(status_code=499)
        choices = [chat_choice(st, c, c.index, mode, named, role, echo, lp(c.token_ids, c.logprobs), ids_out)
                   for c in job.lasts[0].outputs]
        job.close(200)
        out = job.lasts[0]
        return JSONResponse(ChatCompletionResponse(
            id=job.id, created=job.created, model=st.model_name, choices=choices, usage=job.usage(),
            prompt_routed_experts=fmt.routes(out.prompt_routed_experts),
            prompt_logprobs=fmt.prompt_logprobs(text, out, pl),
            prompt_token_ids=list(out.prompt_token_ids) if ids_out else None).model_dump())

    last_usage, every_usage = stream_usage(st, req)

    def chunk(choices, usage=None, **kw):
        if every_usage and usage is None:
            usage = job.usage() if any(o is not None for o in job.lasts) else Usage(
                prompt_tokens=len(prompt), completion_tokens=0, total_tokens=len(prompt))
        return sse(ChatCompletionChunk(id=job.id, created=job.created, model=st.model_name, choices=choices,
                                        usage=usage, **kw))

    async def events():
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role=role, content=""))
                     for i in range(req.n)], prompt_token_ids=list(prompt) if ids_out else None)
        if echo:
            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=echo)) for i in range(req.n)])
        deltas = [fmt.Delta() for _ in range(req.n)]
        splits = [st.reasoning.stream() for _ in range(req.n)]  # each choice's reasoning / content split
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
                    thought, answer = st.reasoning.split(c.text)
                    content, calls = tools.parse(mode, answer, None) if reason != "length" and answer is not None \
                        else (answer, [])
                    delta = ChatDelta(content=content, reasoning_content=thought, reasoning=thought,
                                      tool_calls=[DeltaToolCall(
                        index=j, id=t.id, type="function", function=DeltaFunction(
                            name=t.function.name, arguments=t.function.arguments)) for j, t in enumerate(calls)]
                        or None)
                    reason = "tool_calls" if calls and reason == "stop" else reason
                    lps = c.logprobs
                    ids = c.token_ids
                else:
                    thought, piece = splits[c.index].feed(piece)
                    if reason is not None:  # the end: what was held back as a possible tag goes too
                        more_thought, more = splits[c.index].finish()
                        thought, piece = thought + more_thought, piece + more
                    elif not thought and not piece and not lps and not ids_out:
                        continue  # all held back (maybe a tag): it goes with the next piece
                    delta = ChatDelta(content=piece or None, reasoning_content=thought or None,
                                      reasoning=thought or None)
                yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=lp(ids, lps),
                                             finish_reason=reason, token_ids=list(ids) if ids_out else None)])
        if last_usage:
            yield chunk([], job.usage())

    return JobStream(job, events())
