"""/v1/chat/completions (plain, streamed, beam search), its pieces of the one generation path
(serve/generation.py): the conversation through the chat template (in a worker thread),
tools and structured outputs, vLLM's echo / add_generation_prompt / continue_final_message and custom roles."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from jaxpaged.core.validation import InvalidParam, check_text
from serve import beam, prompt_size, request_rules, tools
from serve import outputs as fmt
from serve.errors import APIError
from serve.generation import Plan, generate
from serve.job import Job, sse
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
from serve.routes import num_logprobs, sampling_params, shown_logprobs, stream_usage, token_text
from serve.tool_parsers.stream import ToolCallStream, merge


def chat_prompt(engine, messages, tool_list=None, add_generation_prompt: bool = True,
                add_special_tokens: bool = False, continue_final_message: bool = False,
                check_size: bool = True, template_kwargs: dict | None = None) -> list[int]:
    """The conversation's token ids (call in a worker thread: it renders and tokenizes). The rendered text
    is refused from its size before it is tokenized if it cannot fit max_model_len (serve/prompt_size.py),
    unless `check_size` is off (the prompt is to be truncated). `template_kwargs`: the request's
    chat_template_kwargs (further template variables)."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so no chat template; use /v1/completions "
                            "with token ids", param="messages")
    msgs, template_tools = tools.render_messages(messages, tool_list, tok.chat_template)
    try:
        text = tok.render_chat_template(msgs, add_generation_prompt, tools=template_tools,
                                        continue_final_message=continue_final_message, template_kwargs=template_kwargs)
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
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = num_logprobs(st, "top_logprobs", req.top_logprobs or 0) if req.logprobs else None
    shown = shown_logprobs(req, k)
    pl = num_logprobs(st, "prompt_logprobs", req.prompt_logprobs)
    rename = {"prompt": "messages", "logprobs": "top_logprobs",
              "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
    structured, mode, rename_so = await tools.constraint(req, st.engine, st.config.max_grammar_bytes,
                                                         st.reasoning.span)
    rename.update(rename_so)
    params = sampling_params(req, max_tokens, k, rename, structured, pl)
    fmt.check_routes_request(req, num_prompts)
    return params, shown, pl, rename, mode, max_tokens


def chat_choice(st, c, index: int, mode, named, role: str, echo: str, logprobs, ids_out: bool,
                schemas: dict | None = None) -> ChatChoice:
    """A non-streamed choice from a finished output `c`: reasoning split, tool calls parsed (tool_choice auto:
    by the server's tool parser, values by the tools' `schemas`), echo first. A call that must come
    (tool_choice named or required) cut before it parses is no call (tool_calls absent, as vLLM's)."""
    thought, answer = st.reasoning.split(c.text)
    cut = c.finish_reason == "length" or answer is None
    content, calls = (answer, []) if cut else tools.parse(mode, answer, named, st.tool_parser, schemas)
    reason = "tool_calls" if calls and mode != "named" and c.finish_reason == "stop" else c.finish_reason
    content = echo + content if content is not None else content
    return ChatChoice(index=index, message=AssistantMessage(
        role=role, content=content, tool_calls=None if cut and mode in ("named", "required") else calls,
        reasoning_content=thought, reasoning=thought),
                      logprobs=logprobs, finish_reason=reason, routed_experts=fmt.routes(c.routed_experts),
                      token_ids=list(c.token_ids) if ids_out else None)


@dataclass(kw_only=True)
class ChatPlan(Plan):
    shown: int | None = None  # the logprobs each token shows (top k, fmt.ALL with logprob_token_ids) or None
    pl: int | None = None  # prompt logprobs or None
    mode: str | None = None  # the tool mode (serve/tools.py)
    named: str | None = None  # the tool a named tool_choice names
    schemas: dict | None = None  # the tools' parameters by name (the tool parser converts values by them)
    role: str = "assistant"  # the answer's role
    echo: str = ""  # the text echoed before the answer
    text: fmt.TokenText | None = None


class Chat:
    """The pieces of /v1/chat/completions."""
    kind, model, prefix = request_rules.CHAT, ChatCompletionRequest, "chatcmpl"

    async def plan(self, st, req: ChatCompletionRequest) -> ChatPlan:
        params, k, pl, rename, mode, max_tokens = await chat_params(st, req)
        use_tools = req.tools if mode is not None else None
        if mode == "auto" and st.tool_parser.keep_special_tokens:  # its markers are special tokens (as vLLM's)
            params.skip_special_tokens = False
        keep, side = truncation(req, st.engine.max_model_len, max_tokens)
        prompt = await asyncio.to_thread(chat_prompt, st.engine, req.messages, use_tools, req.add_generation_prompt,
                                         False, req.continue_final_message, keep is None,
                                         req.chat_template_kwargs)
        prompt = truncate(prompt, keep, side)
        role = "assistant" if req.add_generation_prompt else req.messages[-1].role
        plan = ChatPlan(prompts=[prompt], params=params, rename=rename, shown=k, pl=pl, mode=mode, role=role,
                        named=req.tool_choice.function.name if mode == "named" else None,
                        schemas=tools.schemas_of(use_tools),
                        echo=echo_text(req, req.messages, role), text=token_text(st, req))
        if req.use_beam_search:
            beam.refuse(req, st.max_logprobs)
            plan.params, plan.max_tokens = None, max_tokens
            plan.names = ("messages", rename["max_tokens"])  # max_tokens or max_completion_tokens
        return plan

    def _logprobs(self, plan: ChatPlan, ids, lps):
        return fmt.chat_logprobs(plan.text, ids, lps, plan.shown) if plan.shown is not None else None

    def response(self, st, req, plan: ChatPlan, job: Job) -> ChatCompletionResponse:
        ids_out, out = bool(req.return_token_ids), job.lasts[0]
        choices = [chat_choice(st, c, c.index, plan.mode, plan.named, plan.role, plan.echo,
                               self._logprobs(plan, c.token_ids, c.logprobs), ids_out, plan.schemas)
                   for c in out.outputs]
        return ChatCompletionResponse(
            id=job.id, created=job.created, model=st.model_name, choices=choices, usage=job.usage(),
            prompt_routed_experts=fmt.routes(out.prompt_routed_experts),
            prompt_logprobs=fmt.prompt_logprobs(plan.text, out, plan.pl),
            prompt_token_ids=list(out.prompt_token_ids) if ids_out else None)

    async def events(self, st, req, plan: ChatPlan, job: Job):
        ids_out, prompt, mode, named = bool(req.return_token_ids), plan.prompts[0], plan.mode, plan.named
        last_usage, every_usage = stream_usage(st, req)

        def chunk(choices, usage=None, **kw):
            if every_usage and usage is None:
                usage = job.usage() if any(o is not None for o in job.lasts) else Usage(
                    prompt_tokens=len(prompt), completion_tokens=0, total_tokens=len(prompt))
            return sse(ChatCompletionChunk(id=job.id, created=job.created, model=st.model_name, choices=choices,
                                           usage=usage, **kw))

        no_ids = [] if ids_out else None  # return_token_ids: every chunk's choices carry a list, maybe empty
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role=plan.role, content=""), token_ids=no_ids)
                     for i in range(req.n)], prompt_token_ids=list(prompt) if ids_out else None)
        if plan.echo:
            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=plan.echo), token_ids=no_ids)
                         for i in range(req.n)])
        deltas = [fmt.Delta() for _ in range(req.n)]
        splits = [st.reasoning.stream() for _ in range(req.n)]  # each choice's reasoning / content split
        answers = [""] * req.n  # tool_choice "required": each choice's answer so far, sent when whole
        found = [ToolCallStream(st.tool_parser, plan.schemas) for _ in range(req.n)]  # "auto": calls in the text
        opened = set()  # choices whose tool call has started (named tool_choice)
        async for _, out in job.outputs():
            for c in out.outputs:
                got = deltas[c.index].advance(c)
                if got is None:
                    continue
                piece, ids, lps, reason = got
                if mode == "named":  # the answer is the arguments: stream them as they come
                    thought, args = self._split(splits[c.index], piece, reason)
                    if not thought and not args and reason is None and not lps and not ids_out:
                        continue  # all held back (maybe a tag)
                    call = DeltaToolCall(index=0, function=DeltaFunction(arguments=args)) if args else None
                    if call is not None and c.index not in opened:  # the first piece opens the call
                        opened.add(c.index)
                        call = DeltaToolCall(index=0, id=tools.new_call(named, "").id, type="function",
                                             function=DeltaFunction(name=named, arguments=args))
                    delta = ChatDelta(tool_calls=[call] if call else None, reasoning_content=thought or None,
                                      reasoning=thought or None)
                elif mode == "auto":  # content streams until a call may begin, then the calls' fragments
                    thought, more = self._split(splits[c.index], piece, reason)
                    content, calls = found[c.index].feed(more)
                    if reason is not None:
                        rest, last = found[c.index].finish(cut=reason == "length")
                        content, calls = content + rest, merge(calls, last)
                        reason = "tool_calls" if found[c.index].called and reason == "stop" else reason
                    if not thought and not content and not calls and reason is None and not lps and not ids_out:
                        continue  # all held back
                    delta = ChatDelta(content=content or None, reasoning_content=thought or None,
                                      reasoning=thought or None, tool_calls=calls or None)
                elif mode is not None:  # "required": the reasoning streams as it comes; the calls (with the
                    # tokens and logprobs) once the text is whole
                    thought, more = self._split(splits[c.index], piece, reason)
                    answers[c.index] += more
                    if reason is None:
                        if thought:
                            delta = ChatDelta(reasoning_content=thought, reasoning=thought)
                            yield chunk([ChatChunkChoice(index=c.index, delta=delta, token_ids=no_ids)])
                        continue
                    answer = answers[c.index] or None
                    content, calls = tools.parse(mode, answer, None) if reason != "length" and answer is not None \
                        else (answer, [])
                    delta = ChatDelta(content=content, reasoning_content=thought or None, reasoning=thought or None,
                                      tool_calls=[DeltaToolCall(
                        index=j, id=t.id, type="function", function=DeltaFunction(
                            name=t.function.name, arguments=t.function.arguments)) for j, t in enumerate(calls)]
                        or None)
                    reason = "tool_calls" if calls and reason == "stop" else reason
                    lps = c.logprobs
                    ids = c.token_ids
                else:
                    thought, piece = self._split(splits[c.index], piece, reason)
                    if not thought and not piece and reason is None and not lps and not ids_out:
                        continue  # all held back (maybe a tag): it goes with the next piece
                    delta = ChatDelta(content=piece or None, reasoning_content=thought or None,
                                      reasoning=thought or None)
                yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=self._logprobs(plan, ids, lps),
                                             finish_reason=reason, token_ids=list(ids) if ids_out else None)])
        if last_usage:
            yield chunk([], job.usage())

    @staticmethod
    def _split(split, piece: str, reason) -> tuple[str, str]:
        """(reasoning, content) of a streamed piece; at the end (`reason` set), with what was held back."""
        thought, content = split.feed(piece)
        if reason is not None:
            more_thought, more = split.finish()
            thought, content = thought + more_thought, content + more
        return thought, content

    def beam_answers(self, st, req, plan: ChatPlan, found, head: dict):
        """The beams' texts, each split by the server's reasoning parser; streamed as one chunk per choice."""
        tok, answers, completion, prompt = st.engine.tokenizer, [], 0, plan.prompts[0]
        for s in found.best()[0]:
            out = found.generated(0, s)
            completion += len(out)
            thought, content = st.reasoning.split(tok.decode(out, skip_special_tokens=req.skip_special_tokens))
            answers.append((s, out, thought, plan.echo + content if content is not None else content))
        usage, ids_out = beam.usage([prompt], completion), bool(req.return_token_ids)
        choices = [ChatChoice(index=j, message=AssistantMessage(role=plan.role, content=content,
                                                                reasoning_content=thought, reasoning=thought),
                              finish_reason=s.finish_reason, token_ids=out if ids_out else None)
                   for j, (s, out, thought, content) in enumerate(answers)]
        chunks = [ChatCompletionChunk(**head, choices=[ChatChunkChoice(
            index=j, delta=ChatDelta(role=plan.role, content=content, reasoning_content=thought, reasoning=thought),
            finish_reason=s.finish_reason, token_ids=out if ids_out else None)],
            prompt_token_ids=list(prompt) if ids_out and j == 0 else None)
            for j, (s, out, thought, content) in enumerate(answers)]
        return (ChatCompletionResponse(**head, choices=choices, usage=usage,
                                       prompt_token_ids=list(prompt) if ids_out else None),
                chunks, ChatCompletionChunk(**head, choices=[], usage=usage))


CHAT_ROUTE = Chat()


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    return await generate(request, CHAT_ROUTE)
