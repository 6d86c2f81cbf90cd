"""`hermes`: the `<tool_call>...</tool_call>` blocks of Hermes-style templates (Qwen2.5, Hermes, SmolLM2's
function-calling format), each holding one JSON object, or a list of them, with `name` and `arguments` (or
`parameters`). One block that does not parse makes the whole text content."""
from __future__ import annotations

import json
import re

from serve.body import loads
from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser, join_content
from serve.tool_parsers.partial_calls import blank, json_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        calls = []
        for block in _BLOCK.findall(text):
            try:
                got = loads(block)
                calls += [_call(c) for c in (got if isinstance(got, list) else [got])]
            except (ValueError, TypeError, KeyError, AttributeError):
                return text, []
        if not calls:
            return text, []
        first = _BLOCK.search(text)
        return join_content(text[:first.start()], _BLOCK.sub("", text[first.end():])), calls

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        calls, pos = [], at
        while (begin := text.find(OPEN, pos)) >= 0:
            body = begin + len(OPEN)
            end = text.find(CLOSE, body)
            if end >= 0:  # a whole block: read as `parse` reads it
                got = loads(text[body:end].strip())
                calls += [(c.name, c.arguments) for c in map(_call, got if isinstance(got, list) else [got])]
                pos = end + len(CLOSE)
                continue
            i = blank(text, body)
            if i < len(text):
                calls += json_calls(text, i, _call, "arguments", ensure_ascii=True)[0]
            break
        return calls


def _call(c) -> FunctionCall:
    """A call object's call: `arguments` (or `parameters`) as given when a string, else as JSON text."""
    args = c.get("arguments", c.get("parameters", {}))
    return FunctionCall(name=c["name"], arguments=args if isinstance(args, str) else json.dumps(args))
