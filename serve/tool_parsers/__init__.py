"""Tool-call parsers (`--tool-call-parser`, vLLM's names): how the calls of `tool_choice: "auto"` are read from
a chat answer's text, one syntax per module; `PARSERS` is the registry the flag's choices come from.

Each parser reads a whole text into (content, calls) (`ToolParser.parse`, a pure function; text that does not
parse stays content), says where in a growing text a call may begin (`ToolParser.start`) and reads the calls
begun in a growing text (`ToolParser.partial`), which is all the stream needs (serve/tool_parsers/stream.py:
content before a call streams as it comes, then each call's name and its arguments in pieces as they come;
pythonic's calls each whole once its `)` has come). The content rule is shared (base.py, `join_content`).
"""
from __future__ import annotations

from serve.tool_parsers.base import ToolParser
from serve.tool_parsers.hermes import HermesParser
from serve.tool_parsers.llama3_json import Llama3JsonParser
from serve.tool_parsers.mistral import MistralParser
from serve.tool_parsers.pythonic import PythonicParser
from serve.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Qwen3CoderParser)}
DEFAULT = HermesParser.name  # the syntax read without --tool-call-parser


def make_tool_parser(name: str | None) -> ToolParser:
    """The parser named by --tool-call-parser (None: hermes); ValueError naming the choices for others."""
    if name is None:
        name = DEFAULT
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
