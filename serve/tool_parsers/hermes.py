"""`hermes`: the `<tool_call>...</tool_call>` blocks of Hermes-style templates (Qwen2.5, Hermes, SmolLM2's
function-calling format), each holding one JSON object, or a list of them, with `name` and `arguments` (or
`parameters`). One block that does not parse makes the whole text content."""
from __future__ import annotations

import json
import re

from serve.body import loads
from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser, join_content

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        calls = []
        for block in _BLOCK.findall(text):
            try:
                got = loads(block)
                for c in got if isinstance(got, list) else [got]:
                    args = c.get("arguments", c.get("parameters", {}))
                    calls.append(FunctionCall(name=c["name"], arguments=args if isinstance(args, str)
                                              else json.dumps(args)))
            except (ValueError, TypeError, KeyError, AttributeError):
                return text, []
        if not calls:
            return text, []
        first = _BLOCK.search(text)
        return join_content(text[:first.start()], _BLOCK.sub("", text[first.end():])), calls
