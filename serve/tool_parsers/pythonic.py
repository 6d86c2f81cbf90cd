"""`pythonic`: calls written as a Python list, `[get_weather(city="SF"), f(x=1)]` (Llama 3.2's and 4's
pythonic format, ToolACE's). The list is read with Python's `ast` parser and nothing is evaluated: each
element must be a call of a plain (or dotted) name with keyword arguments, each argument a literal
(string, number, True / False / None, a list, tuple or dict of literals, a dict's keys strings), else the
text is content. The text before the list (and after it) is content (vLLM's parser reads an answer that
is the list alone)."""
from __future__ import annotations

import ast
import json
import math
import re

from serve.protocol_tools import FunctionCall
from serve.tool_parsers.base import ToolParser, join_content, too_deep

_OPEN = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")  # a list whose first element is a call
_OPENING = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")  # the text ends inside such an opening


class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, schemas: dict[str, dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        if too_deep(text):
            return text, []
        for m in _OPEN.finditer(text):
            close = text.find("]", m.end())
            while close >= 0:  # the first `]` that closes a list which parses is the list's end
                try:
                    tree = ast.parse(text[m.start():close + 1], mode="eval")
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    close = text.find("]", close + 1)
                    continue
                try:
                    calls = [_call(e) for e in tree.body.elts]
                except (ValueError, AttributeError):
                    break  # a list, not of calls of literals: maybe a later one is
                return join_content(text[:m.start()], text[close + 1:]), calls
        return text, []

    def start(self, text: str, pos: int = 0) -> tuple[int, bool] | None:
        at = text.find("[", pos)
        while at >= 0:
            if _OPEN.match(text, at):
                return at, True
            if _OPENING.match(text, at):
                return at, False
            at = text.find("[", at + 1)
        return None

    def partial(self, text: str, at: int, schemas: dict[str, dict] | None = None) -> list[tuple[str, str]]:
        """The calls whose `)` has come, each whole (a Python call is read whole): the longest start of the
        list, up to a `)`, that reads as a list of calls once closed."""
        if too_deep(text) or not _OPEN.match(text, at):
            return []
        found, close = [], text.find(")", at)
        while close >= 0:
            try:
                tree = ast.parse(text[at:close + 1] + "]", mode="eval")
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                tree = None
            if tree is not None and isinstance(tree.body, ast.List):
                found = tree.body.elts
            close = text.find(")", close + 1)
        return [(c.name, c.arguments) for c in map(_call, found)]


def _call(node: ast.expr) -> FunctionCall:
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise ValueError("each element must be a call with keyword arguments only")
    return FunctionCall(name=_name(node.func), arguments=json.dumps(
        {k.arg: literal(k.value) for k in node.keywords}, ensure_ascii=False))


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    raise ValueError("a call's function must be a name")


def literal(node: ast.expr):
    """The JSON value of a literal expression; ValueError for anything else (nothing is evaluated)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int)) or
                                           isinstance(node.value, float) and math.isfinite(node.value)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                          for k in node.keys):
        return {k.value: literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
