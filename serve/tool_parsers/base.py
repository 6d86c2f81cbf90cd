"""What every tool-call syntax shares: the `ToolParser` interface (a whole text -> content and calls; where
in a growing text a call may begin, for the stream), the content rule, and JSON read out of running text.

The content rule (`join_content`): the text outside the calls, with the whitespace before the first call
and at the end dropped; leading whitespace too when nothing but whitespace comes before the first call.
A text without calls is content as it is. So the content a stream sends before a call (the text before
the place a call may begin, its trailing whitespace held back) is always the start of the whole text's
content, whether a call follows or not (serve/tool_parsers/stream.py).
"""
from __future__ import annotations

import json
import uuid

from serve.body import MAX_JSON_DEPTH, nesting_depth
from serve.protocol_tools import FunctionCall

_DECODER = json.JSONDecoder()


class ToolParser:
    """One syntax of tool calls in a model's text (`--tool-call-parser NAME`)."""
    name: str = ""
    markers: tuple[str, ...] = ()  # literal texts that open a call (the default `start` looks for them)
    keep_special_tokens = False  # the markers are special tokens: decode without skipping them (tools given)

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        """(content or None, calls) of a whole text; `schemas`: each tool's JSON-schema parameters by name.
        A text whose calls do not parse has no calls: all of it is content."""
        raise NotImplementedError

    def start(self, text: str, pos: int = 0) -> tuple[int, bool] | None:
        """Where at or after `pos` a call may begin in `text`, and whether its opening is whole there (False:
        the text ends with the start of an opening, so what comes next decides); None: nowhere."""
        best = None
        for m in self.markers:
            at = text.find(m, pos)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, True)
        if best is None:
            for m in self.markers:
                n = held(text[pos:], m)
                if n and (best is None or len(text) - n < best[0]):
                    best = (len(text) - n, False)
        return best

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        """The calls begun in a growing `text` whose calls begin at `at` (where `start` found them), each as
        (name, the start of its arguments): every call's name and arguments are the start of what `parse`
        gives once the text is whole, if it is calls. [] here: the calls go out whole at the end. ValueError
        when the text can no longer be calls."""
        return []

    def call_id(self) -> str:
        """A new tool call's id."""
        return new_call_id()


def new_call_id() -> str:
    """A tool call id as OpenAI's: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def held(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def join_content(head: str, tail: str) -> str | None:
    """The content of a text with calls: `head` (the text before the first call) and `tail` (the text outside
    the calls after it), by the rule above; None when nothing is left."""
    text = (head + tail).rstrip()
    return (text if head.strip() else text.lstrip()) or None


def too_deep(text: str) -> bool:
    """JSON in `text` would nest deeper than the request bodies may (serve/body.py): such text is not parsed."""
    return text.count("[") + text.count("{") > MAX_JSON_DEPTH and nesting_depth(text) > MAX_JSON_DEPTH


def json_at(text: str, at: int):
    """(the JSON value that starts at `text[at]`, the index after it); ValueError when none does."""
    return _DECODER.raw_decode(text, at)


def call(name, arguments) -> FunctionCall:
    """A call from a parsed name and arguments (a JSON object, or its text); ValueError for anything else."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ValueError("a call needs a name and an object of arguments")
    return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
