"""The rendering of a /v1/responses answer: its output items (reasoning, message, function calls), the response
body, and keeping it in the server's store (serve/responses_store.py) with its conversation."""
from __future__ import annotations

import uuid

from serve.protocol import Usage
from serve.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    ResponseUsage,
)
from serve.responses_protocol import Response as ResponseBody


def new_id(kind: str) -> str:
    """A new output item id: `kind` (msg, rs, fc), "_", 24 hex digits."""
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def answer_message(items: list) -> dict | None:
    """An answer's output items as the assistant message the next turn's conversation holds (reasoning left
    out, as chat leaves it out; a function call cut short, `incomplete`, too: a stream sends its text again as
    a message when the answer is whole)."""
    texts = [p.text for i in items if i.type == "message" for p in i.content]
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in items if i.type == "function_call" and i.status == "completed"]
    if not texts and not calls:
        return None
    return {"role": "assistant", "content": "".join(texts) if texts else None,
            **({"tool_calls": calls} if calls else {})}


def output_items(thought: str | None, content: str | None, calls) -> list:
    """An answer's output items: its reasoning, its text (a message, even empty, unless there are calls), its
    function calls (each as OpenAI orders them)."""
    items: list = []
    if thought:
        items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=thought)]))
    if content or (content is not None and not calls):
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=content)]))
    items += [FunctionCallItem(id=new_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments)
              for c in calls]
    return items


def response_usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(
        cached_tokens=cached), output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                         total_tokens=usage.total_tokens)


def body(st, req: ResponsesRequest, response_id: str, created: int, items: list, finish_reason: str | None,
         usage: Usage | None) -> ResponseBody:
    """The response: in progress while `finish_reason` is None, incomplete when the length cut it."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    return ResponseBody(
        id=response_id, created_at=created, model=st.model_name, status=status, output=items,
        usage=response_usage(usage), instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, previous_response_id=req.previous_response_id,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=req.tool_choice if isinstance(req.tool_choice, str) else
        req.tool_choice.model_dump() if req.tool_choice else "auto" if req.tools else "none",
        parallel_tool_calls=req.parallel_tool_calls, store=req.store, metadata=req.metadata, user=req.user,
        text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else
        {"format": {"type": "text"}})


def keep(st, req: ResponsesRequest, history: list[dict], response: ResponseBody) -> None:
    """Store a finished response (unless `store` is false) with its conversation."""
    if req.store and response.status != "in_progress":
        answer = answer_message(response.output)
        st.responses.put(response, history + ([answer] if answer else []))
