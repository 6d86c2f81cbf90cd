"""`mistral`: Mistral's calls after `[TOOL_CALLS]`, in the form of its tokenizer's version: a JSON list of
`{"name": ..., "arguments": {...}}` (v3; one object is read too), `NAME{...}` (v11) or `NAME[ARGS]{...}`
(v13 and later), the latter two once per call, each after its own `[TOOL_CALLS]`. The text before the first
`[TOOL_CALLS]` (and any after the calls) is content. `[TOOL_CALLS]` and `[ARGS]` are special tokens, so with
tools the answer is decoded keeping special tokens (as vLLM's parser asks). Call ids are 9 letters and
digits, as Mistral's templates require."""
from __future__ import annotations

import random
import re
import string

from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser, call, join_content, json_at, too_deep
from serve.tool_parsers.partial_calls import blank, json_calls
from serve.tool_parsers.partial_json import prefix

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?\s*(?=\{)")
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TAG,)
    keep_special_tokens = True

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        first = text.find(TAG)
        if first < 0 or too_deep(text):
            return text, []
        calls, at = [], first
        try:
            while text.startswith(TAG, at):
                at += len(TAG)
                got, at = _calls_after(text, at)
                calls += got
                at = len(text) - len(text[at:].lstrip())
        except (ValueError, TypeError, KeyError):
            return text, []
        if not calls:
            return text, []
        return join_content(text[:first], text[at:]), calls

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        calls, i = [], at
        while text.startswith(TAG, i):
            i = blank(text, i + len(TAG))
            if i == len(text):
                break
            if text[i] in "[{":
                got, end = json_calls(text, i, _v3, "arguments", ensure_ascii=False)
            elif (named := _NAME.match(text, i)) is None:
                break  # the name is not whole yet
            else:
                args, end = prefix(text, named.end())
                c = (named.group(1), args) if end is None else (named.group(1), call(
                    named.group(1), json_at(text, named.end())[0]).arguments)
                got = [c]
            calls += got
            if end is None:
                break
            i = blank(text, end)
        return calls

    def call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))


def _calls_after(text: str, at: int) -> tuple[list[FunctionCall], int]:
    """The calls right after a `[TOOL_CALLS]` that ends at `at`, and the index after them; ValueError if none."""
    lead = len(text) - len(text[at:].lstrip())
    if text.startswith(("[", "{"), lead):
        got, end = json_at(text, lead)
        return [_v3(c) for c in (got if isinstance(got, list) else [got])], end
    named = _NAME.match(text, at)
    if named is None:
        raise ValueError(f"no call after {TAG}")
    args, end = json_at(text, named.end())
    return [call(named.group(1), args)], end


def _v3(c) -> FunctionCall:
    """A v3 call object's call."""
    return call(c["name"], c["arguments"])
