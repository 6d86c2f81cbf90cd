"""A streamed /v1/responses answer as OpenAI's typed server-sent events (`event: TYPE` and `data: {...}` with a
`sequence_number`): response.created and response.in_progress, then per output item
response.output_item.added, its content's events (response.content_part.added, response.output_text.delta /
response.reasoning_text.delta ..., .done, response.content_part.done; a function call's
response.function_call_arguments.delta / .done) and response.output_item.done, and last response.completed (or
response.incomplete when max_output_tokens cut it) with the whole response.

Text without tools streams as it comes (reasoning, split by the server's reasoning parser, before it); with
tools the output is parsed once it is whole (as chat's stream does), then its items are sent."""
from __future__ import annotations

import json

from serve import outputs as fmt
from serve.responses_protocol import FunctionCallItem, OutputMessage, OutputText, ReasoningItem, ReasoningText
from serve.responses_render import body, keep, new_id

# an item kind -> (its content part's type, its delta / done events' prefix)
_PARTS = {"message": ("output_text", "response.output_text"), "reasoning": ("reasoning_text",
                                                                            "response.reasoning_text")}


class EventWriter:
    """Numbered events, and the output items sent so far (one open at a time)."""

    def __init__(self):
        self.seq = 0
        self.items: list = []  # the finished items, in output order
        self.open = None  # (kind, id, text so far) of the item being streamed

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def text(self, kind: str, piece: str, force: bool = False):
        """Events sending `piece` of an item of `kind` (message / reasoning): an item of another kind open
        before is finished, a new one opened (with `force`, even for an empty piece)."""
        if not piece and not force:
            return
        if self.open is not None and self.open[0] != kind:
            yield from self.close()
        index = len(self.items)
        if self.open is None:
            item_id = new_id("msg" if kind == "message" else "rs")
            item = OutputMessage(id=item_id, status="in_progress", content=[]) if kind == "message" else \
                ReasoningItem(id=item_id, status="in_progress", content=[])
            self.open = (kind, item_id, "")
            yield self.event("response.output_item.added", output_index=index, item=item.model_dump())
            yield self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                             part=self._part(kind, ""))
        kind, item_id, text = self.open
        self.open = (kind, item_id, text + piece)
        if not piece:
            return
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.event(_PARTS[kind][1] + ".delta", item_id=item_id, output_index=index, content_index=0,
                         delta=piece, **extra)

    def close(self):
        """Events finishing the open item (if any)."""
        if self.open is None:
            return
        kind, item_id, text = self.open
        index, self.open = len(self.items), None
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.event(_PARTS[kind][1] + ".done", item_id=item_id, output_index=index, content_index=0, text=text,
                         **extra)
        yield self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                         part=self._part(kind, text))
        item = OutputMessage(id=item_id, content=[OutputText(text=text)]) if kind == "message" else \
            ReasoningItem(id=item_id, content=[ReasoningText(text=text)])
        yield from self.done(item, index)

    def whole(self, item):
        """Events sending a finished item at once."""
        yield from self.close()
        if isinstance(item, FunctionCallItem):
            index = len(self.items)
            yield self.event("response.output_item.added", output_index=index,
                             item=item.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump())
            yield self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                             delta=item.arguments)
            yield self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                             name=item.name, arguments=item.arguments)
            yield from self.done(item, index)
        else:
            yield from self.text(item.type, item.content[0].text, force=True)
            yield from self.close()

    def done(self, item, index: int):
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=index, item=item.model_dump())

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        return OutputText(text=text).model_dump() if kind == "message" else ReasoningText(text=text).model_dump()


async def events(st, req, plan, job, items):
    """The events of a streamed /v1/responses job; `items(output)`: a finished output's items (tools)."""
    w, mode = EventWriter(), plan.chat_plan.mode
    start = body(st, req, job.id, job.created, [], None, None).model_dump()
    yield w.event("response.created", response=start)
    yield w.event("response.in_progress", response=start)
    delta, split, reason = fmt.Delta(), st.reasoning.stream(), None
    async for _, out in job.outputs():
        c = out.outputs[0]
        got = delta.advance(c)
        if got is None:
            continue
        piece, _, _, reason = got
        if mode is not None:  # tools: the calls are known once the text is whole
            if reason is not None:
                for item in items(c):
                    for e in w.whole(item):
                        yield e
            continue
        thought, text = split.feed(piece)
        if reason is not None:  # the end: what was held back as a possible tag goes too
            more_thought, more = split.finish()
            thought, text = thought + more_thought, text + more
        for e in [*w.text("reasoning", thought), *w.text("message", text)]:
            yield e
    if mode is None and not (w.open is not None and w.open[0] == "message"):  # no text: an empty message, as
        for e in w.text("message", "", force=True):  # when not streamed
            yield e
    for e in w.close():
        yield e
    final = body(st, req, job.id, job.created, w.items, reason or "stop", job.usage())
    keep(st, req, plan.history, final)
    yield w.event("response.incomplete" if final.status == "incomplete" else "response.completed",
                  response=final.model_dump())
