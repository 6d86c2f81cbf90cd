"""`qwen3_coder`: Qwen3-Coder's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    San Francisco
    </parameter>
    </function>
    </tool_call>

each parameter's text (one newline after its opening and one before its closing dropped) converted by the
tool's JSON-schema type for it: "string" as it is, "integer" / "number" / "boolean" / "null" read as such,
"object" / "array" as JSON (or a Python literal, read by `ast`, never evaluated); a value that does not fit
its type, or a parameter the schema does not name, stays a string; `null` is None for a parameter the
schema types (as vLLM's). A `</function>` or `</tool_call>` missing at the end of the text is taken as there (the model
stopped on it). The text before the first call is content."""
from __future__ import annotations

import ast
import json
import math
import re

from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser, join_content
from serve.tool_parsers.pythonic import literal

_CALL = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>)?|\Z)", re.S)
_OPENING = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>")
_WHOLE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=))", re.S)  # a parameter that has ended
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        calls, at, first = [], 0, None
        while (m := _CALL.search(text, at)) is not None:
            if first is None:
                first = m.start()
            elif text[at:m.start()].strip():
                break  # text between calls: the calls are over
            try:
                calls.append(_call(m.group(1).strip(), m.group(2), schemas))
            except ValueError:
                return text, []
            at = m.end()
        if not calls:
            return text, []
        return join_content(text[:first], text[at:]), calls

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        calls, i = [], at
        while (m := _OPENING.search(text, i)) is not None and not (calls and text[i:m.start()].strip()):
            name = m.group(1).strip()
            if text.find("</function>", m.end()) >= 0:  # a whole call: read as `parse` reads it
                whole = _CALL.match(text, m.start())
                calls.append((name, _call(name, whole.group(2), schemas).arguments))
                i = whole.end()
                continue
            props = _properties((schemas or {}).get(name))  # the call the text ends inside: its whole parameters
            calls.append((name, "{" + ", ".join(f"{json.dumps(p.strip(), ensure_ascii=False)}: " + json.dumps(
                _value(v, props.get(p.strip())), ensure_ascii=False) for p, v in _WHOLE.findall(text, m.end()))))
            break
        return calls


def _call(name: str, body: str, schemas: dict[str, dict] | None) -> FunctionCall:
    """A call from its name and the text inside `<function=...>`; ValueError when it is not one."""
    if not name or _PARAM.sub("", body).strip():
        raise ValueError("a call with text outside its parameters is not one")
    props = _properties((schemas or {}).get(name))
    args = {p.strip(): _value(v, props.get(p.strip())) for p, v in _PARAM.findall(body)}
    return FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _properties(schema) -> dict:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _value(raw: str, schema):
    """A parameter's text as the value its schema's type says (a string when it does not fit)."""
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if not types:
        return raw
    if raw.strip().lower() == "null":
        return None
    if "string" in types:
        return raw
    for t in types:
        try:
            return _as(raw.strip(), t)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            continue
    return raw


def _as(text: str, kind: str):
    """`text` read as JSON-schema type `kind`; ValueError when it is not one."""
    if kind == "integer":
        return int(text)
    if kind == "number":
        try:
            return int(text)
        except ValueError:
            value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text} is not a finite number")
        return value
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in ("object", "array"):
        try:
            value = json.loads(text)
        except ValueError:
            value = literal(ast.parse(text, mode="eval").body)
        if isinstance(value, dict if kind == "object" else list):
            return value
    raise ValueError(f"{text[:40]!r} is not of type {kind}")
