"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: a route of the one generation
path (serve/generation.py). Its plan makes the request a chat request (the stored conversation of
`previous_response_id`, then `instructions` as a system message, then `input`; function tools, `tool_choice`,
`text.format` as response_format) and plans that as chat does (serve/chat.py: the same prompt, tools and
structured outputs, so greedy text equals chat's); its render makes output items (reasoning, message, function
calls) of the answer; serve/responses_stream.py streams them as typed events as they are generated. Finished
responses are kept in the server's store (serve/responses_store.py) unless `store` is false."""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve import request_rules, responses_stream
from serve.chat import CHAT_ROUTE, chat_choice
from serve.errors import APIError, from_validation_error
from serve.generation import Plan, generate
from serve.job import Job
from serve.protocol import ChatCompletionRequest
from serve.responses_protocol import DeletedResponse, ResponsesRequest
from serve.responses_protocol import Response as ResponseBody
from serve.responses_render import body, keep, output_items
from serve.routes import check_auth

# a chat request's fields (as chat's errors and the engine's name them, by prefix) -> the Responses request's
FIELDS = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"), ("messages", "input"),
          ("prompt", "input"), ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
          ("tools.function.", "tools."))


def field_name(chat_field: str | None) -> str | None:
    """The Responses request's name of a chat request's field (e.g. response_format -> text.format)."""
    for chat, ours in FIELDS:
        if chat_field is not None and chat_field.startswith(chat):
            return ours + chat_field[len(chat):]
    return chat_field


def renamed(e: APIError) -> APIError:
    """A chat planning error, naming the Responses request's field (in its param and its message)."""
    param = field_name(e.param)
    if e.param is not None and param != e.param:
        e.message = e.message.replace(e.param, param)
        e.args = (e.message,)
    e.param = param
    return e


def input_messages(given) -> list[dict]:
    """The request's `input` as chat messages: a string is a user message; function calls join the assistant
    message before them (or make one), function_call_output items are tool messages."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    msgs: list[dict] = []
    for item in given:
        if item.type == "message":
            content = item.content if isinstance(item.content, str) else \
                [{"type": "text", "text": p.text} for p in item.content]
            msgs.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1] = {**msgs[-1], "tool_calls": msgs[-1].get("tool_calls", []) + [call]}
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return msgs


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request of a Responses request whose earlier conversation is `history`."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {"model": req.model, "messages": system + history, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stream": req.stream}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # the input's items made a conversation chat refuses
        raise renamed(from_validation_error(e)) from None


@dataclass(kw_only=True)
class ResponsesPlan(Plan):
    chat: ChatCompletionRequest | None = None  # the request as chat planned it
    chat_plan: Plan | None = None
    history: list[dict] | None = None  # the conversation without instructions, for the store


class Responses:
    """The pieces of /v1/responses."""
    kind, model, prefix = request_rules.RESPONSES, ResponsesRequest, "resp"

    async def plan(self, st, req: ResponsesRequest) -> ResponsesPlan:
        history = []
        if req.previous_response_id is not None:
            prev = st.responses.get(req.previous_response_id)
            if prev is None:
                raise APIError(400, f"previous_response_id: no stored response {req.previous_response_id!r} "
                                    f"(never made, not stored, deleted, or dropped from the newest "
                                    f"{st.responses.capacity} kept)", param="previous_response_id",
                               code="previous_response_not_found")
            history = list(prev.messages)
        history += input_messages(req.input)
        chat = chat_request(req, history)
        try:
            inner = await CHAT_ROUTE.plan(st, chat)
        except APIError as e:
            raise renamed(e) from None
        rename = {k: field_name(v) for k, v in inner.rename.items()}
        return ResponsesPlan(prompts=inner.prompts, params=inner.params, rename=rename, chat=chat, chat_plan=inner,
                             history=history)

    def items(self, st, plan: ResponsesPlan, c) -> list:
        """The output items of a finished output `c`, parsed as chat parses its choice."""
        inner = plan.chat_plan
        m = chat_choice(st, c, 0, inner.mode, inner.named, "assistant", "", None, False, inner.schemas).message
        return output_items(m.reasoning_content, m.content, m.tool_calls or [])

    def response(self, st, req: ResponsesRequest, plan: ResponsesPlan, job: Job) -> ResponseBody:
        c = job.lasts[0].outputs[0]
        out = body(st, req, job.id, job.created, self.items(st, plan, c), c.finish_reason or "stop", job.usage())
        keep(st, req, plan.history, out)
        return out

    def events(self, st, req: ResponsesRequest, plan: ResponsesPlan, job: Job):
        return responses_stream.events(st, req, plan, job)


RESPONSES_ROUTE = Responses()


async def create(request: Request) -> Response:
    """POST /v1/responses."""
    return await generate(request, RESPONSES_ROUTE)


def _stored(request: Request):
    check_auth(request)
    st, rid = request.app.state.server, request.path_params["response_id"]
    return st, rid


async def stored(request: Request) -> Response:
    """GET or DELETE /v1/responses/{response_id} (one route, so a 405's Allow lists both)."""
    return await (retrieve if request.method in ("GET", "HEAD") else delete)(request)


async def retrieve(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a stored response (404 if none)."""
    st, rid = _stored(request)
    got = st.responses.get(rid)
    if got is None:
        raise APIError(404, f"no stored response {rid!r}", param="response_id", code="response_not_found")
    return JSONResponse(got.response.model_dump())


async def delete(request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: forget a stored response (404 if none)."""
    st, rid = _stored(request)
    if not st.responses.delete(rid):
        raise APIError(404, f"no stored response {rid!r}", param="response_id", code="response_not_found")
    return JSONResponse(DeletedResponse(id=rid).model_dump())

