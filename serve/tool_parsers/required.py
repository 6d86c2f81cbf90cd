"""The answer of `tool_choice: "required"`: the JSON list of `{"name", "arguments"}` objects its grammar makes
(serve/tools.py), read whole and while it grows (serve/tool_parsers/partial_calls.py) so a stream can send
the calls' arguments as they come. Not a `--tool-call-parser` syntax: the request's constraint decides it."""
from __future__ import annotations

import json

from serve.body import loads
from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser
from serve.tool_parsers.partial_calls import blank, json_calls


class RequiredParser(ToolParser):
    name = "required"

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        """(None, the calls) of a whole answer; (the text, []) when it is not a list of calls (cut short)."""
        try:
            return None, [_convert(c) for c in loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []

    def start(self, text: str, pos: int = 0) -> tuple[int, bool] | None:
        """The calls begin at the answer's first character that is not a blank."""
        at = blank(text, pos)
        return (at, True) if at < len(text) else None

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        if text[at] != "[":
            raise ValueError("a required tool call answer is a JSON list")
        return json_calls(text, at, _convert, "arguments", True)[0]


def _convert(c) -> FunctionCall:
    """A call object of the list (KeyError / TypeError when it is not one); arguments as `json.dumps` writes."""
    return FunctionCall(name=c["name"], arguments=json.dumps(c["arguments"]))
