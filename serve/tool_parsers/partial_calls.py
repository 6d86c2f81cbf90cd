"""Calls written as JSON objects (`{"name": ..., "arguments": {...}}`, alone or in a list), read while they
are generated: the whole ones as the parser reads them, and the one the text ends inside as its name and the
start of its arguments (serve/tool_parsers/partial_json.py), for the stream's argument fragments
(serve/tool_parsers/stream.py). The arguments stream only from the key the parser prefers, and only once
the name has come (a call whose arguments come first, or under the other key, goes out when it is whole)."""
from __future__ import annotations

from typing import Callable

from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import json_at
from serve.tool_parsers.partial_json import prefix

Convert = Callable[[object], FunctionCall]  # a whole call object -> its call; ValueError / KeyError / TypeError if none


def blank(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not a blank (len(text) if none)."""
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def json_calls(text: str, i: int, convert: Convert, key: str, ensure_ascii: bool
               ) -> tuple[list[tuple[str, str]], int | None]:
    """The calls of the JSON object, or list of objects, at `text[i]`: (name, arguments) of each whole one,
    then of the one the text ends inside (see `open_call`); and the index after the value (None while the
    text ends inside it). ValueError (or KeyError / TypeError from `convert`) when the text cannot be calls."""
    try:
        value, end = json_at(text, i)
    except ValueError:
        pass
    else:
        return [_pair(convert(v)) for v in (value if isinstance(value, list) else [value])], end
    if text[i] == "{":
        got = open_call(text, i, key, ensure_ascii)
        return ([got] if got else []), None
    calls, j = [], i + 1
    while True:
        j = blank(text, j)
        if j == len(text) or text[j] != "{":
            return calls, None
        try:
            obj, end = json_at(text, j)
        except ValueError:
            got = open_call(text, j, key, ensure_ascii)
            return calls + ([got] if got else []), None
        calls.append(_pair(convert(obj)))
        j = blank(text, end)
        if not text.startswith(",", j):
            return calls, None
        j += 1


def open_call(text: str, i: int, key: str, ensure_ascii: bool) -> tuple[str, str] | None:
    """(name, the arguments so far) of the call object at `text[i]` that the text ends inside: None until its
    `name` is read and an object under `key` has begun."""
    name, args = None, None
    i += 1
    while True:
        i = blank(text, i)
        if i == len(text) or text[i] != '"':
            break
        try:
            field, i = json_at(text, i)
        except ValueError:
            break  # the key is not whole yet
        i = blank(text, i)
        if not text.startswith(":", i) or (i := blank(text, i + 1)) == len(text):
            break
        if field == key and text[i] == "{":
            args, end = prefix(text, i, ensure_ascii)
        else:
            _, end = prefix(text, i)
            if end is not None and field == "name":
                name = json_at(text, i)[0]
        if end is None:
            break
        i = blank(text, end)
        if not text.startswith(",", i):
            break
        i += 1
    return (name, args) if isinstance(name, str) and name and args is not None else None


def _pair(c: FunctionCall) -> tuple[str, str]:
    return c.name, c.arguments
