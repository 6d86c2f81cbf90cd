"""A constraint that applies after a reasoning model's thinking (host only, no llguidance import here).

A reasoning model writes free text first (`<think>…</think>`), then its answer; vLLM constrains only the
answer. Here the same is one grammar: `ReasoningSpan` says where the free text is, and `after_reasoning`
puts it before the constraint's own grammar (an llguidance grammar as `StructuredOutputsParams` compiles it:
Lark text, or the JSON of a list of grammars). The free part is one lazy lexeme, ended by the first `end`,
so text after it is the answer's however it looks; blanks between the two are allowed. No step or runner
change follows: the request's matcher reads every output token, and its mask lets every token through
(EOS aside) until the reasoning ends.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a reasoning model's free text is, before the constrained answer.

    end: the text that ends the reasoning ("</think>"). start: None when the output begins inside the
    reasoning (the chat template opened it, as DeepSeek-R1's): the output is free text up to `end`, then
    the answer; or the text that opens it (Qwen3's "<think>"): the output is either an opened and closed
    reasoning block, then the answer, or the answer alone."""
    end: str
    start: str | None = None

    def __post_init__(self):
        for name in ("end", "start"):
            v = getattr(self, name)
            if not (isinstance(v, str) and v) and not (name == "start" and v is None):
                raise ValueError(f"ReasoningSpan.{name} must be a non-empty string, got {v!r}")


_FREE = "/(.|\\n)*/"  # any text; lazy inside the rule below, so it stops at the first end marker
_BLANK = "BLANK: /[ \\t\\r\\n]+/"


def after_reasoning(grammar: str, span: ReasoningSpan) -> str:
    """The llguidance grammar `grammar` (Lark text, or `{"grammars": [...]}` JSON) preceded by the free text
    of `span`: a top-level grammar whose start rule is the reasoning then the original's start grammar,
    referenced by name."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    subs = [dict(g) for g in top["grammars"]]
    taken = {g.get("name") for g in subs}
    answer = subs[0].get("name") or _fresh("answer", taken)  # a named one keeps its name (others may refer to it)
    subs[0]["name"] = answer
    end = json.dumps(span.end)
    if span.start is None:  # begins inside the reasoning: it must end before the answer
        lark = f"start: think BLANK? @{answer}\nthink[lazy]: {_FREE} {end}\n"
    else:  # an optional reasoning block, opened by `start`
        lark = f"start: (think BLANK?)? @{answer}\nthink[lazy]: {json.dumps(span.start)} {_FREE} {end}\n"
    head = {"name": _fresh("reasoned", taken | {answer}), "lark_grammar": lark + _BLANK + "\n"}
    return json.dumps({**top, "grammars": [head] + subs})


def _fresh(base: str, taken: set) -> str:
    return next(name for i in range(len(taken) + 1) if (name := f"{base}{i or ''}") not in taken)
