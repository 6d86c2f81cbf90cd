"""One streamed choice's tool calls under `tool_choice: "auto"`: the answer's text before the place a call
may begin goes out as content as it comes; from there on the text is held, and once the answer is whole
it is parsed as the non-streamed answer is, its calls sent as tool-call deltas (one entry per call: its
index, id, type, name and its whole arguments) with the rest of the content. Whitespace that ends the text
sent so far is held too (the content drops it before a call). So the deltas put together equal the
non-streamed message: the content sent early is always the start of the whole text's content (the rule of
serve/tool_parsers/base.py)."""
from __future__ import annotations

from serve.protocol_tools import DeltaFunction, DeltaToolCall
from serve.tool_parsers.base import ToolParser


class ToolCallStream:
    """`feed(piece)` -> content to send now; `finish()` -> (the rest of the content, the calls' deltas)."""

    def __init__(self, parser: ToolParser, schemas: dict[str, dict] | None = None):
        self.parser, self.schemas = parser, schemas
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.inside = False  # a call's opening has come: the rest waits for the end

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.inside:
            return ""
        begins = self.parser.start(self.text, self.sent)
        end = len(self.text) if begins is None else begins[0]
        self.inside = begins is not None and begins[1]
        out = self.text[self.sent:end].rstrip()
        self.sent += len(out)
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """What is left to send once the answer is whole: the content not yet sent ("" if none), and one
        delta per call, in order. `cut`: the answer was cut short (max_tokens): not parsed, all content."""
        content, calls = self.parser.parse(self.text, self.schemas) if not cut else (self.text, [])
        rest = (content or "")[self.sent:] if calls else self.text[self.sent:]
        return rest, [DeltaToolCall(index=j, id=self.parser.call_id(), type="function",
                                    function=DeltaFunction(name=c.name, arguments=c.arguments))
                      for j, c in enumerate(calls)]
