"""A streamed /v1/responses answer as OpenAI's typed server-sent events (`event: TYPE` and `data: {...}` with a
`sequence_number`): response.created and response.in_progress, then per output item
response.output_item.added, its content's events (response.content_part.added, response.output_text.delta /
response.reasoning_text.delta ..., .done, response.content_part.done; a function call's
response.function_call_arguments.delta ... / .done) and response.output_item.done, and last response.completed
(or response.incomplete when max_output_tokens cut it) with the whole response.

Everything streams as it is generated, as chat's stream sends it (serve/chat.py): the reasoning (split by the
server's reasoning parser), then by the tool mode (serve/responses_answer.py) the text, and the function calls'
arguments as they come (`tool_choice` auto: read by the server's tool parser while they grow; a named
function: the answer is its arguments); `tool_choice` required sends its calls once the answer is whole."""
from __future__ import annotations

import json
from dataclasses import dataclass

from serve import outputs as fmt
from serve.responses_answer import answer_stream
from serve.responses_protocol import FunctionCallItem, OutputMessage, OutputText, ReasoningItem, ReasoningText
from serve.responses_render import body, keep, new_id

# an item kind -> (its content part's type, its delta / done events' prefix)
_PARTS = {"message": ("output_text", "response.output_text"), "reasoning": ("reasoning_text",
                                                                            "response.reasoning_text")}


@dataclass
class _Open:
    """The item being streamed."""
    kind: str  # message, reasoning or function_call
    id: str
    text: str = ""  # its text (a call: its arguments) so far
    call_id: str = ""  # a function call's
    name: str = ""  # a function call's


class EventWriter:
    """Numbered events, and the output items sent so far (one open at a time)."""

    def __init__(self):
        self.seq = 0
        self.items: list = []  # the finished items, in output order
        self.open: _Open | None = None

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def text(self, kind: str, piece: str, force: bool = False):
        """Events sending `piece` of an item of `kind` (message / reasoning): an item of another kind open
        before is finished, a new one opened (with `force`, even for an empty piece)."""
        if not piece and not force:
            return
        if self.open is not None and self.open.kind != kind:
            yield from self.close()
        index = len(self.items)
        if self.open is None:
            self.open = _Open(kind, new_id("msg" if kind == "message" else "rs"))
            item = OutputMessage(id=self.open.id, status="in_progress", content=[]) if kind == "message" else \
                ReasoningItem(id=self.open.id, status="in_progress", content=[])
            yield self.event("response.output_item.added", output_index=index, item=item.model_dump())
            yield self.event("response.content_part.added", item_id=self.open.id, output_index=index,
                             content_index=0, part=self._part(kind, ""))
        self.open.text += piece
        if not piece:
            return
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.event(_PARTS[kind][1] + ".delta", item_id=self.open.id, output_index=index, content_index=0,
                         delta=piece, **extra)

    def call(self, call_id: str, name: str):
        """Events opening a function call item (the item open before is finished)."""
        yield from self.close()
        self.open = _Open("function_call", new_id("fc"), call_id=call_id, name=name)
        yield self.event("response.output_item.added", output_index=len(self.items),
                         item=self._call_item("in_progress").model_dump())

    def arguments(self, piece: str):
        """Events sending the next `piece` of the open function call's arguments."""
        if not piece:
            return
        self.open.text += piece
        yield self.event("response.function_call_arguments.delta", item_id=self.open.id,
                         output_index=len(self.items), delta=piece)

    def close(self, status: str = "completed"):
        """Events finishing the open item (if any); a function call cut short is `status` incomplete."""
        if self.open is None:
            return
        o, index = self.open, len(self.items)
        if o.kind == "function_call":
            yield self.event("response.function_call_arguments.done", item_id=o.id, output_index=index,
                             name=o.name, arguments=o.text)
            item = self._call_item(status)
        else:
            extra = {"logprobs": []} if o.kind == "message" else {}
            yield self.event(_PARTS[o.kind][1] + ".done", item_id=o.id, output_index=index, content_index=0,
                             text=o.text, **extra)
            yield self.event("response.content_part.done", item_id=o.id, output_index=index, content_index=0,
                             part=self._part(o.kind, o.text))
            item = OutputMessage(id=o.id, content=[OutputText(text=o.text)]) if o.kind == "message" else \
                ReasoningItem(id=o.id, content=[ReasoningText(text=o.text)])
        self.open = None
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=index, item=item.model_dump())

    def has_answer(self) -> bool:
        """Whether a message or a function call has been sent (or is open)."""
        return any(i.type != "reasoning" for i in self.items) or (self.open is not None and
                                                                  self.open.kind != "reasoning")

    def _call_item(self, status: str) -> FunctionCallItem:
        o = self.open
        return FunctionCallItem(id=o.id, call_id=o.call_id, name=o.name, status=status,
                                arguments=o.text if status != "in_progress" else "")

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        return OutputText(text=text).model_dump() if kind == "message" else ReasoningText(text=text).model_dump()


async def events(st, req, plan, job):
    """The events of a streamed /v1/responses job."""
    w = EventWriter()
    start = body(st, req, job.id, job.created, [], None, None).model_dump()
    yield w.event("response.created", response=start)
    yield w.event("response.in_progress", response=start)
    delta, split, answer, reason = fmt.Delta(), st.reasoning.stream(), answer_stream(st, plan.chat_plan), None
    async for _, out in job.outputs():
        got = delta.advance(out.outputs[0])
        if got is None:
            continue
        piece, _, _, reason = got
        thought, text = split.feed(piece)
        if reason is not None:  # the end: what was held back as a possible tag goes too
            more_thought, more = split.finish()
            thought, text = thought + more_thought, text + more
        for e in w.text("reasoning", thought):
            yield e
        for e in answer.feed(w, text, reason):
            yield e
    if not w.has_answer():  # no text: an empty message, as when not streamed
        for e in w.text("message", "", force=True):
            yield e
    for e in w.close():
        yield e
    final = body(st, req, job.id, job.created, w.items, reason or "stop", job.usage())
    keep(st, req, plan.history, final)
    yield w.event("response.incomplete" if final.status == "incomplete" else "response.completed",
                  response=final.model_dump())
