"""JSON read while it is generated, for the argument fragments of streamed tool calls: the part of a JSON
value that the text so far fixes, written as `json.dumps` writes the whole value (`", "` and `": "` between
items, strings re-escaped, numbers as Python reads and writes them). A string's characters are final as
they come (an escape is held until it is whole, a surrogate pair until both halves are); a number or a
literal is held until the character after it, since more digits may follow. So what `prefix` returns for a
text is always the start of what it returns for any longer text that begins with it, and, once the value is
whole, equal to `json.dumps(json.loads(value))` (for objects without a repeated key: `json.loads` keeps the
last of those, the stream has sent the first).
"""
from __future__ import annotations

import json
import re

from serve.body import MAX_JSON_DEPTH

_WS = " \t\n\r"
_PLAIN = re.compile(r'[^"\\]*')  # a run of a string's characters that need no look
_HIGH = ("d8", "d9", "da", "db")  # the first hex digits of a high surrogate


class Incomplete(Exception):
    """The text ends inside the value."""


def prefix(text: str, at: int, ensure_ascii: bool = False) -> tuple[str, int | None]:
    """(the fixed start of `json.dumps(value, ensure_ascii=...)` of the JSON value that begins at `text[at]`
    (after blanks), the index after the value, or None while the text ends inside it). ValueError when the
    text cannot be the start of a JSON value."""
    out: list[str] = []
    try:
        end = _value(text, at, out, ensure_ascii, 0)
    except Incomplete:
        return "".join(out), None
    return "".join(out), end


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    if i == len(text):
        raise Incomplete
    return i


def _value(text: str, i: int, out: list[str], ascii_only: bool, depth: int) -> int:
    i = _skip(text, i)
    ch = text[i]
    if ch in "{[":
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return _container(text, i, out, ascii_only, depth + 1)
    if ch == '"':
        return _string(text, i, out, ascii_only)
    j = i
    while j < len(text) and text[j] not in ",]}" + _WS:
        j += 1
    if j == len(text):
        raise Incomplete  # a number or literal may go on
    out.append(json.dumps(json.loads(text[i:j])))  # ValueError when it is neither
    return j


def _container(text: str, i: int, out: list[str], ascii_only: bool, depth: int) -> int:
    close, is_object = ("}", True) if text[i] == "{" else ("]", False)
    out.append(text[i])
    i = _skip(text, i + 1)
    if text[i] == close:
        out.append(close)
        return i + 1
    while True:
        if is_object:
            if text[i] != '"':
                raise ValueError(f"expected a key at character {i}")
            i = _skip(text, _string(text, i, out, ascii_only))
            if text[i] != ":":
                raise ValueError(f"expected ':' at character {i}")
            out.append(": ")
            i += 1
        i = _skip(text, _value(text, i, out, ascii_only, depth))
        if text[i] == close:
            out.append(close)
            return i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or {close!r} at character {i}")
        out.append(", ")
        i = _skip(text, i + 1)


def _string(text: str, i: int, out: list[str], ascii_only: bool) -> int:
    j = i + 1
    while (j := _PLAIN.match(text, j).end()) < len(text):
        c = text[j]
        if c == '"':
            out.append(json.dumps(json.loads(text[i:j + 1]), ensure_ascii=ascii_only))
            return j + 1
        end = j + 2
        if text.startswith("u", j + 1):
            end = j + 6
            if text[j + 2:j + 4].lower() in _HIGH:  # a surrogate pair's first half: the pair goes together
                end = len(text) + 1 if len(text) < end + 2 else end + 6 if text.startswith("\\u", end) else end
        if end > len(text):
            break  # the escape is not whole: held
        j = end
    out.append(json.dumps(json.loads(text[i:j] + '"'), ensure_ascii=ascii_only)[:-1])
    raise Incomplete
