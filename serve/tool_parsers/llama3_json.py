"""`llama3_json`: Llama 3.x's JSON calls, `{"name": "f", "parameters": {...}}` (or `"arguments"`), after an
optional `<|python_tag|>`, several separated by `;`. The first JSON object in the text that is such a call
starts the calls, the ones after it each follow a `;`; the text before and after them is content (vLLM's
parser drops that text)."""
from __future__ import annotations

import re

from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser, call, held, join_content, json_at, too_deep
from serve.tool_parsers.partial_calls import blank, json_calls

TAG = "<|python_tag|>"
_OPEN = re.compile(r"\{\s*(\"|\Z)")  # a call object opens with a key (or the text ends inside its opening)
_SEP = re.compile(r"\s*;\s*")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        if too_deep(text):
            return text, []
        at = text.find("{")
        while at >= 0:
            try:
                obj, end = json_at(text, at)
            except ValueError:
                at = text.find("{", at + 1)
                continue
            first = _call(obj)
            if first is None:  # JSON, but not a call: its inner objects are not calls either
                at = text.find("{", end)
                continue
            calls = [first]
            while (sep := _SEP.match(text, end)) and text.startswith("{", sep.end()):
                try:
                    obj, after = json_at(text, sep.end())
                except ValueError:
                    break
                if (more := _call(obj)) is None:
                    break
                calls.append(more)
                end = after
            head = text[:at].rstrip()
            return join_content(head[:-len(TAG)] if head.endswith(TAG) else head, text[end:]), calls
        return text, []

    def start(self, text: str, pos: int = 0) -> tuple[int, bool] | None:
        tag = text.find(TAG, pos)
        brace = text.find("{", pos)
        while brace >= 0 and (tag < 0 or brace < tag):
            opening = _OPEN.match(text, brace)
            if opening:
                return brace, opening.group(1) == '"'
            brace = text.find("{", brace + 1)
        if tag >= 0:
            return tag, True
        n = held(text[pos:], TAG)
        return (len(text) - n, False) if n else None

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        i = blank(text, at + len(TAG)) if text.startswith(TAG, at) else at
        calls = []
        while text.startswith("{", i):
            got, end = json_calls(text, i, _strict, "parameters", ensure_ascii=False)
            calls += got
            sep = _SEP.match(text, end) if end is not None else None
            if sep is None or not text.startswith("{", sep.end()):
                break
            i = sep.end()
        return calls


def _strict(obj) -> FunctionCall:
    """The call a whole object is; ValueError when it is none (the stream then waits for the end)."""
    got = _call(obj)
    if got is None:
        raise ValueError("not a call object")
    return got


def _call(obj) -> FunctionCall | None:
    """The call an object is (None if it is none): a `name` and `parameters` or `arguments`."""
    if not isinstance(obj, dict) or "name" not in obj or ("parameters" not in obj and "arguments" not in obj):
        return None
    try:
        return call(obj["name"], obj["parameters"] if "parameters" in obj else obj["arguments"])
    except ValueError:
        return None
