"""The answer of a streamed /v1/responses output (after its reasoning), sent by the request's tool mode as chat's
stream sends it (serve/chat.py), as output items of an EventWriter (serve/responses_stream.py): text as a
message as it comes; `tool_choice` auto: the text before a call as a message, then each call as a
function_call item whose arguments go out as the server's tool parser reads them while they grow
(serve/tool_parsers/stream.py); `tool_choice` required alike, its JSON list read as it grows
(serve/tool_parsers/required.py); a named function: the answer is its arguments, sent as they come. An
answer whose calls turn out not to be calls (malformed, or cut by max_output_tokens) ends its open call
`incomplete` and sends the text not yet sent (a named call's: its arguments) as a message, as chat's stream
(which cannot take back what it sent)."""
from __future__ import annotations

from serve import tools
from serve.tool_parsers.base import new_call_id
from serve.tool_parsers.stream import ToolCallStream


def answer_stream(st, chat_plan):
    """The answer stream of a request planned as `chat_plan` (serve/chat.py's ChatPlan)."""
    if chat_plan.mode == "auto":
        return AutoCalls(ToolCallStream(st.tool_parser, chat_plan.schemas))
    if chat_plan.mode == "named":
        return NamedCall(chat_plan.named)
    if chat_plan.mode is not None:  # required: its JSON list read as it grows
        return AutoCalls(ToolCallStream(tools.REQUIRED))
    return Text()


class Text:
    """No tools: the answer is a message."""

    def feed(self, w, text: str, reason: str | None):
        """Events for the answer's next `text`; `reason`: the finish reason once it is whole."""
        yield from w.text("message", text)


class NamedCall:
    """A named function: the answer is the call's arguments."""

    def __init__(self, name: str):
        self.name, self.text = name, ""

    def feed(self, w, text: str, reason: str | None):
        if text and not self.text:
            yield from w.call(new_call_id(), self.name)
        self.text += text
        yield from w.arguments(text)
        if reason is not None and self.text:
            yield from w.close("incomplete" if reason == "length" else "completed")
            if reason == "length":  # cut before it was whole: no call, its text is content (as unstreamed)
                yield from w.text("message", self.text)


class AutoCalls:
    """`tool_choice` auto (or required): content, then calls read by the tool parser (the server's, or
    required's) while they are generated."""

    def __init__(self, found: ToolCallStream):
        self.found = found

    def feed(self, w, text: str, reason: str | None):
        content, deltas = self.found.feed(text)
        yield from w.text("message", content)
        yield from _calls(w, deltas)
        if reason is None:
            return
        sent = bool(self.found.calls)
        rest, deltas = self.found.finish(cut=reason == "length")
        if sent and not self.found.called:  # what went out as a call is not one: the rest is content
            yield from w.close("incomplete")
            yield from w.text("message", rest)
        elif sent:  # the calls' last pieces, then the content after them
            yield from _calls(w, deltas)
            yield from w.close()
            yield from w.text("message", rest)
        else:  # the calls came whole at the end: the content first, as the unstreamed order
            yield from w.text("message", rest)
            yield from _calls(w, deltas)
            yield from w.close()


def _calls(w, deltas):
    """Events for a tool-call stream's deltas: a call's first (with its id) opens its item."""
    for d in deltas:
        if d.id is not None:
            yield from w.call(d.id, d.function.name)
        yield from w.arguments(d.function.arguments)
