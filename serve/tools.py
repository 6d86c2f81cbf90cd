"""Constrained output on the HTTP routes: which constraint a request puts on the output
(`structured_outputs`, `response_format`, chat `tool_choice`), the tools' place in the prompt, and model
output -> OpenAI tool calls.

A constraint's work is bounded before it starts: its text (a JSON schema serialized, a regex, a grammar, the
choices; for tool_choice "required", the schema combining every tool's parameters) is at most
`--max-grammar-bytes` (else a 400 `grammar_too_large` naming the field), measured before any llguidance call;
then it is compiled and its matcher built for the model's tokenizer in a worker thread, never on the event
loop nor on the engine thread (`AsyncEngine.prepare_structured`).

Tool-call syntax ("auto"): the server's tool parser's (`--tool-call-parser`, serve/tool_parsers/; by default
the `<tool_call>...</tool_call>` blocks of Hermes-style templates). A chat template that renders `tools`
itself gets them as the `tools` variable; one that does not (SmolLM2's) gets a system message listing the
tools and the Hermes syntax. Earlier calls in the conversation likewise: as `tool_calls` to a template that
renders them, else as Hermes text.
"""
from __future__ import annotations

import asyncio
import json

from jaxpaged.core.reasoned import ReasoningSpan
from jaxpaged.core.structured import StructuredOutputsParams, source_text
from jaxpaged.core.validation import InvalidParam
from serve.body import loads
from serve.errors import APIError
from serve.protocol_tools import FunctionCall, ToolCall
from serve.tool_parsers import HermesParser, ToolParser
from serve.tool_parsers.base import new_call_id
from serve.tool_parsers.required import RequiredParser

_HERMES = HermesParser()
REQUIRED = RequiredParser()  # tool_choice "required"'s JSON list of calls
_ANY_OBJECT = {"type": "object"}
DEFAULT_MAX_GRAMMAR_BYTES = 64 * 2 ** 10  # a request's constraint text (--max-grammar-bytes)


async def constraint(req, engine, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES, reasoning: ReasoningSpan | None = None
                     ) -> tuple[StructuredOutputsParams | None, str | None, dict]:
    """(the output's constraint or None, tool mode: None | "named" | "required" | "auto", the rename of
    the engine's `structured_outputs` param to the request field it came from); APIError 400
    when two fields constrain the output, tool_choice names no tool, the constraint's text is over
    `max_bytes`, or the library refuses it. The constraint is sized, compiled and its matcher built (for
    `engine`'s tokenizer) in a worker thread. `reasoning` (the server's reasoning parser's span): the
    constraint applies after the model's reasoning (core/reasoned.py), as vLLM's."""
    tools = getattr(req, "tools", None) or []
    choice = getattr(req, "tool_choice", None) or ("auto" if tools else "none")
    rf = getattr(req, "response_format", None)
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice {_name(choice)} needs tools", param="tool_choice",
                       code="invalid_combination")
    named = None
    if not isinstance(choice, str):
        named = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in "
                                "tools", param="tool_choice", code="invalid_combination")
    sources = [name for name, on in (("structured_outputs", req.structured_outputs is not None),
                                     ("response_format", rf is not None and rf.type != "text"),
                                     ("tool_choice", named is not None or choice == "required")) if on]
    if len(sources) > 1:
        raise APIError(400, f"{' and '.join(sources)} both constrain the output; give one",
                       param=sources[1], code="invalid_combination")
    mode = "named" if named else choice if choice in ("required", "auto") else None
    if not sources:
        return None, mode, {}
    label = f"tools.function.parameters (the {len(tools)} tools' together, as one schema for tool_choice " \
        "required)" if sources[0] == "tool_choice" and not named else None
    so = await asyncio.to_thread(lambda: _compile(*_constraint(req, sources[0], named, tools), label, engine,
                                                  max_bytes, reasoning))
    return so, mode, {"structured_outputs": sources[0]}


def _constraint(req, source: str, named, tools) -> tuple[dict, str | None]:
    """(StructuredOutputsParams' fields, the request field they come from; None: structured_outputs.KIND)."""
    rf = getattr(req, "response_format", None)
    if source == "structured_outputs":
        so = req.structured_outputs
        kw = {k: getattr(so, k) for k in ("regex", "choice", "grammar", "json_object") if getattr(so, k) is not None}
        if so.json_ is not None:
            kw["json"] = so.json_
        return kw, None
    if source == "response_format":
        if rf.type == "json_object":
            return {"json_object": True}, "response_format"
        return {"json": rf.json_schema.schema_ or _ANY_OBJECT}, "response_format.json_schema.schema"
    if named:
        return {"json": named.parameters or _ANY_OBJECT}, "tools.function.parameters"
    defs: dict = {}
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": _lifted(t.function.parameters or _ANY_OBJECT, i, defs)},
              "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return {"json": {**schema, "$defs": defs} if defs else schema}, "tools.function.parameters"


_DEFS = ("$defs", "definitions")


def _lifted(params: dict, i: int, defs: dict) -> dict:
    """Tool i's parameters as a part of the combined schema: a schema whose references are local ("#...")
    moves to the root's `$defs` as `tool{i}`, its own definitions beside it as `tool{i}.NAME`, every local
    reference rewritten to match (a reference resolves from the root of the whole schema)."""
    if not _has_local_ref(params):
        return params
    own = f"tool{i}"

    def target(ref: str) -> str:
        parts = ref[1:].split("/", 3)  # "#/$defs/NAME/rest" -> ["", "$defs", "NAME", "rest"]
        if len(parts) >= 3 and parts[1] in _DEFS:
            return "/".join([f"#/$defs/{own}.{parts[2]}"] + parts[3:])
        return f"#/$defs/{own}{ref[1:]}"

    def rewrite(node):
        if isinstance(node, dict):
            return {k: target(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else rewrite(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key in _DEFS:
        for name, sub in (params.get(key) or {}).items() if isinstance(params.get(key), dict) else ():
            defs[f"{own}.{name}"] = rewrite(sub)
    defs[own] = rewrite({k: v for k, v in params.items() if k not in _DEFS})
    return {"$ref": f"#/$defs/{own}"}


def _has_local_ref(node) -> bool:
    if isinstance(node, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or _has_local_ref(v)
                   for k, v in node.items())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _name(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _compile(kw: dict, param: str | None, label: str | None, engine, max_bytes: int,
             reasoning: ReasoningSpan | None) -> StructuredOutputsParams:
    """The constraint sized (no llguidance call before), compiled and its matcher built (in a worker thread)."""
    if len(kw) == 1:  # more than one: StructuredOutputsParams refuses it, naming them
        (kind, value), = kw.items()
        size = len(source_text(kind, value).encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            field = param or f"structured_outputs.{kind}"
            raise APIError(400, f"{label or field} is {size} bytes; the limit is {max_bytes} bytes "
                           "(--max-grammar-bytes)", param=field, code="grammar_too_large")
    try:
        so = StructuredOutputsParams(**kw, reasoning=reasoning)
        engine.prepare_structured(so)
        return so
    except InvalidParam as e:
        msg = str(e) if param is None else str(e).replace(e.param, param, 1)
        raise APIError(400, msg, param=param or e.param, code=e.code) from None


# -- the prompt ---------------------------------------------------------------------------------
def render_messages(messages, tools, template: str | None) -> tuple[list[dict], list | None]:
    """(messages for the chat template, tools for it, or None when they went into a system message). Earlier
    assistant tool calls go to a template that renders `tool_calls` as such (each call's `arguments` an
    object, as Hugging Face's templates take them; a tool result's `tool_call_id` beside its content), so it
    writes them in its model's own format; for a template that does not, they are Hermes
    `<tool_call>` text after the message's content."""
    msgs, own_calls = [], bool(template and "tool_calls" in template)
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "\n".join(p.text for p in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role}
        if getattr(m, "tool_calls", None) and own_calls:  # the template writes them in its model's format
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}} for c in m.tool_calls]
        elif getattr(m, "tool_calls", None):
            calls = [{"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}
                     for c in m.tool_calls]
            content = (content or "") + f"<tool_call>{json.dumps(calls)}</tool_call>"
        if getattr(m, "tool_call_id", None) and own_calls:
            msg["tool_call_id"] = m.tool_call_id
        msgs.append({**msg, "content": content or ""})
    if not tools:
        return msgs, None
    specs = [t.function.model_dump(exclude_none=True) for t in tools]
    if template and "tools" in template:
        return msgs, [{"type": "function", "function": s} for s in specs]
    note = ("You may call these functions (JSON signatures):\n" + "\n".join(json.dumps(s) for s in specs) +
            '\nTo call functions, answer only with <tool_call>[{"name": <function name>, "arguments": '
            "<arguments object>}, ...]</tool_call>. Otherwise answer normally.")
    if msgs and msgs[0]["role"] == "system":
        msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
    else:
        msgs.insert(0, {"role": "system", "content": note})
    return msgs, None


def _loads_or_text(s: str):
    try:
        return loads(s)
    except ValueError:
        return s


# -- the output ---------------------------------------------------------------------------------
def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def parse(mode: str | None, text: str, named: str | None, parser: ToolParser | None = None,
          schemas: dict[str, dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of one choice's text under a tool mode; "auto" reads the syntax of `parser`
    (None: hermes), converting values by the tools' `schemas` where its syntax needs them. Output that does
    not parse (cut by max_tokens, or no call in "auto") stays content; a named call's content is "" (as
    vLLM's)."""
    if mode == "named":
        return "", [new_call(named, text)]
    if mode == "required":
        content, found = REQUIRED.parse(text)
        return content, [ToolCall(id=new_call_id(), function=c) for c in found]
    if mode == "auto":
        parser = parser or _HERMES
        content, found = parser.parse(text, schemas)
        return content, [ToolCall(id=parser.call_id(), function=c) for c in found]
    return text, []


def schemas_of(tools) -> dict[str, dict]:
    """Each tool's JSON-schema parameters by name (what a parser converts argument values by)."""
    return {t.function.name: t.function.parameters or {} for t in tools or []}
