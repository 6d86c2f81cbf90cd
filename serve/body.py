"""The request body as JSON: read within the size limit, decoded, nested at most MAX_JSON_DEPTH deep, parsed.

Python's JSON parser recurses once per level of arrays and objects, so a body nested thousands of levels
deep would exhaust the interpreter's recursion limit (a 500). The depth is measured first, without
recursion: the running count of the brackets outside strings, in time linear in the body. A body nested
deeper is a 400 with code `nested_too_deeply`. JSON that arrives inside strings (an earlier assistant
message's tool-call arguments, tool calls in the model's output) goes through `loads`, which refuses the
same depth with a ValueError: such text is then kept as text, as when it is not JSON at all.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
from starlette.requests import ClientDisconnect, Request

from serve.errors import APIError

MAX_JSON_DEPTH = 64  # arrays and objects inside one another, the body's own object counting as 1
_STEP = np.zeros(256, np.int8)  # byte -> +1 (opens an array or object), -1 (closes one), 0
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1
_STEP.flags.writeable = False
_QUOTE = ord('"')


def nesting_depth(text: str) -> int:
    """How many arrays and objects the JSON `text` nests inside one another (0 for a scalar), counting the
    brackets outside strings. On malformed text, at least the depth the parser reaches before it fails."""
    # Escaped backslashes, then escaped quotes, go first (paired left to right, as the parser reads them);
    # a bracket is then outside strings where an even number of quotes precede it (an unclosed string
    # runs to the end). In numpy: 16 MiB of brackets, or of escapes, take well under a second.
    b = np.frombuffer(text.replace("\\\\", "").replace('\\"', "").encode("utf-8", "surrogatepass"), np.uint8)
    b = b[(_STEP[b] != 0) | (b == _QUOTE)]
    outside = (np.cumsum(b == _QUOTE, dtype=np.int32) & 1) == 0
    step = _STEP[b[outside]]
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def _too_deep(text: str) -> int:
    """The nesting depth of `text` if over MAX_JSON_DEPTH, else 0 (few brackets in all: not even counted)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # most bodies: 1 µs instead of 50
        return 0
    depth = nesting_depth(text)
    return depth if depth > MAX_JSON_DEPTH else 0


def loads(text: str):
    """`json.loads`, but a ValueError (before any parsing) for text nested deeper than MAX_JSON_DEPTH: for
    JSON that arrives inside strings (tool-call arguments in a request, tool calls in the model's output)."""
    depth = _too_deep(text)
    if depth:
        raise ValueError(f"JSON nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
    return json.loads(text)


async def read_json(request: Request, limit: int, timeout: float | None = None) -> dict:
    """The body of `request` as a JSON object: at most `limit` bytes (else 413), read whole within `timeout`
    seconds (else 408), UTF-8/16/32 as JSON allows, finite numbers only, nested at most MAX_JSON_DEPTH deep;
    any failure is an APIError (a client that disconnects while sending it: 499)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is {length} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                                   code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"the request body was not received within {timeout:g}s ({len(body)} bytes came; "
                       "--request-body-timeout)", code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:  # nobody to answer: one quiet log line (the app's APIError handler), no traceback
        raise APIError(499, f"the client disconnected after {len(body)} bytes of its body",
                       code="client_disconnected") from None
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads(bytes) does
    except UnicodeDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    depth = _too_deep(text)
    if depth:
        raise APIError(400, f"the JSON body is nested too deeply: {depth} levels of arrays and objects; the "
                       f"limit is {MAX_JSON_DEPTH}", code="nested_too_deeply")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")
