"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a chat answer's text split into the model's
reasoning (`message.reasoning_content`, and vLLM's newer `reasoning`) and the rest (`content`).

A parser splits a whole text (`split`) or a stream of text pieces (`stream()`: a `ReasoningStream`, fed
each new piece); the split is done on text, so a tag cut across tokens (or across pieces anyhow) is found,
and text that may be the start of a tag is held back until the next piece tells. `ReasoningParser` itself is
the do-nothing default (no reasoning: all content).

- `deepseek_r1`: the chat template opens the thinking, so the output may start inside it: an opening
  `<think>` at the very start is dropped; everything up to `</think>` is reasoning, the rest content; no
  `</think>` (cut by max_tokens) means all reasoning.
- `qwen3`: both tags are expected: an output that starts with `<think>` and holds `</think>` is split
  there; anything else is all content. Streamed, the text after an opening `<think>` is sent as reasoning
  until `</think>` comes; a stream cut before `</think>` has sent reasoning that the whole text, split at
  the end, would count as content (vLLM's parser does the same).

Each parser names where its reasoning is (`span`, a `ReasoningSpan`): a constrained output of the request
(`tool_choice` named or required, `response_format`, `structured_outputs`) applies after it, as vLLM's
(jaxpaged/core/reasoned.py: the reasoning and the constraint are one grammar).
"""
from __future__ import annotations

from jaxpaged.core.reasoned import ReasoningSpan

START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag` (held back until the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's streamed split: `feed(piece)` -> (reasoning, content) to send now; `finish()` -> what
    was held back. The default sends everything as content."""

    def __init__(self, starts_inside: bool = False, needs_start: bool = False):
        # state: "start" (the opening tag may come), "reasoning", "content"
        self.state = "start" if (starts_inside or needs_start) else "content"
        self.starts_inside = starts_inside  # deepseek_r1: no opening tag means already reasoning
        self.buf = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.buf = self.buf + piece, ""
        reasoning = content = ""
        if self.state == "start":
            if START.startswith(text) and len(text) < len(START):
                self.buf = text  # still possibly the opening tag
                return "", ""
            if text.startswith(START):
                text, self.state = text[len(START):], "reasoning"
            else:
                self.state = "reasoning" if self.starts_inside else "content"
        if self.state == "reasoning":
            at = text.find(END)
            if at < 0:
                keep = _held(text, END)
                reasoning, self.buf = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
            reasoning, text, self.state = text[:at], text[at + len(END):], "content"
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text held back, in the field it belongs to now that no more comes."""
        text, self.buf = self.buf, ""
        if self.state == "start":
            return (text, "") if self.starts_inside else ("", text)
        return (text, "") if self.state == "reasoning" else ("", text)


class ReasoningParser:
    """The do-nothing default: no reasoning, the whole text is content."""
    name: str | None = None
    span: ReasoningSpan | None = None  # where the reasoning is: a constrained output applies after it

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole output."""
        return None, text

    def stream(self) -> ReasoningStream:
        return ReasoningStream()

    @property
    def active(self) -> bool:
        return self.name is not None


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    span = ReasoningSpan(end=END)  # the output begins inside the reasoning

    def split(self, text: str) -> tuple[str | None, str | None]:
        if text.startswith(START):
            text = text[len(START):]
        reasoning, end, content = text.partition(END)
        return reasoning, (content or None) if end else None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(starts_inside=True)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    span = ReasoningSpan(end=END, start=START)  # an optional <think>...</think> block first

    def split(self, text: str) -> tuple[str | None, str | None]:
        if not text.startswith(START) or END not in text:
            return None, text
        reasoning, _, content = text[len(START):].partition(END)
        return reasoning, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(needs_start=True)


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def make_parser(name: str | None) -> ReasoningParser:
    """The parser named by --reasoning-parser (None: the default, no reasoning); ValueError for others."""
    if name is None:
        return ReasoningParser()
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
