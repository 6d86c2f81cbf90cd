"""One streamed choice's tool calls under `tool_choice: "auto"`: the answer's text before the place a call
may begin goes out as content as it comes; from there on the text is read as calls while it grows
(`ToolParser.partial`): a call's first delta carries its index, id, type, name and the start of its
arguments, the later ones the arguments' next pieces, as vLLM streams them. Once the answer is whole it is
parsed as the non-streamed answer is: what the calls' arguments still lack, the calls not yet begun, and the
rest of the content go out. Whitespace that ends the content sent so far is held (the content drops it
before a call). So for an answer that is calls the deltas put together equal the non-streamed message: the
content sent early is always the start of the whole text's content (the rule of serve/tool_parsers/base.py),
and each call's arguments so far the start of its whole arguments. An answer whose calls turn out not to be
calls (a call that does not parse, or cut by `max_tokens`) is content, as unstreamed: the text not sent as
content goes out as content at the end, after whatever of the calls had gone out (as vLLM's stream, which
cannot take back what it sent)."""
from __future__ import annotations

from serve.protocol_tools import DeltaFunction, DeltaToolCall
from serve.tool_parsers.base import ToolParser


class ToolCallStream:
    """`feed(piece)` -> (content, tool-call deltas) to send now; `finish()` -> the same for the rest."""

    def __init__(self, parser: ToolParser, schemas: dict[str, dict] | None = None):
        self.parser, self.schemas = parser, schemas
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.begin: int | None = None  # where a call's opening has come: the rest is read as calls
        self.calls: list[tuple[str, str]] = []  # each call sent so far: (name, arguments sent)
        self.broken = False  # the text can no longer be calls: nothing more is sent until the end
        self.called = False  # finished, and the answer is calls (finish_reason "tool_calls")

    def feed(self, piece: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += piece
        out = ""
        if self.begin is None:
            begins = self.parser.start(self.text, self.sent)
            end = len(self.text) if begins is None else begins[0]
            out = self.text[self.sent:end].rstrip()
            self.sent += len(out)
            if begins is None or not begins[1]:
                return out, []
            self.begin = begins[0]
        return out, self._fragments()

    def _fragments(self) -> list[DeltaToolCall]:
        if self.broken:
            return []
        try:
            now = self.parser.partial(self.text, self.begin, self.schemas)
        except (ValueError, TypeError, KeyError, AttributeError):
            now = None
        if now is None or not _extends(now, self.calls[:len(now)]):
            self.broken = True
            return []
        return self._extend(now)

    def _extend(self, now: list[tuple[str, str]]) -> list[DeltaToolCall]:
        """The deltas that take the calls sent to `now` (each sent call's arguments a start of now's)."""
        deltas = []
        for j, (name, args) in enumerate(now):
            if j < len(self.calls):
                more = args[len(self.calls[j][1]):]
                if more:
                    deltas.append(DeltaToolCall(index=j, function=DeltaFunction(arguments=more)))
            else:
                deltas.append(DeltaToolCall(index=j, id=self.parser.call_id(), type="function",
                                            function=DeltaFunction(name=name, arguments=args)))
        self.calls = now + self.calls[len(now):]
        return deltas

    def finish(self, cut: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """What is left to send once the answer is whole: the content not yet sent ("" if none), and the
        calls' deltas, in order. `cut`: the answer was cut short (max_tokens): not parsed, all content."""
        content, calls = self.parser.parse(self.text, self.schemas) if not cut else (self.text, [])
        now = [(c.name, c.arguments) for c in calls]
        if not _extends(now, self.calls):
            now = []  # not the calls that went out: all of it is content
        self.called = bool(now)
        if not now:
            return self.text[self.sent:], []
        return (content or "")[self.sent:], self._extend(now)


def _extends(now: list[tuple[str, str]], sent: list[tuple[str, str]]) -> bool:
    """`now` holds every call of `sent`, each with its name and its arguments going on from what was sent."""
    return len(now) >= len(sent) and all(name == was[0] and args.startswith(was[1])
                                         for (name, args), was in zip(now, sent))


def merge(first: list[DeltaToolCall], then: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Deltas sent in one chunk: `then` after `first`, one entry per call (arguments joined in order)."""
    out: dict[int, DeltaToolCall] = {}
    for d in first + then:
        if d.index in out:
            out[d.index].function.arguments += d.function.arguments
        else:
            out[d.index] = d.model_copy(deep=True)
    return list(out.values())
