"""Structured outputs (host only): grammars on llguidance, one matcher per constrained request, and the
per-slot packed token bitmask the step applies.

`StructuredOutputsParams` (vLLM's names: json, regex, choice, grammar, json_object) compiles its
constraint to an llguidance grammar and checks it on creation: a bad schema, regex or grammar raises
`InvalidParam` carrying the library's message; checked again unchanged (`SamplingParams`, `add_request`),
it is not compiled again. `StructuredOutputs.prepare` compiles its matcher for the model's tokenizer
ahead of `add_request` (the server calls it in a worker thread): the engine thread then only copies it.
`StructuredOutputs` keeps a matcher per request (weakly: it goes with the request) and advances it lazily,
on the request's output tokens, so it survives preemption and recompute (same tokens) and never depends on the batch.
Each step, `bitmask_arrays` fills `bitmask i32[S, ceil(V/32)]` (bit j of word w allows token 32*w + j; all ones for
unconstrained slots) and the flag `any_mask`; with no constrained slot it returns a constant array that
stays on device.

llguidance was chosen over xgrammar (both measured over SmolLM2's 49k vocabulary; docs/server.md):
both fill a mask in microseconds, but llguidance reads tokenizer.json directly and imports in 0.07 s,
where xgrammar needs transformers and torch (3.6 s to import).
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.core.logit_controls import allowed_row
from jaxpaged.core.reasoned import ReasoningSpan, after_reasoning
from jaxpaged.core.validation import InvalidParam

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output; exactly one of the fields is set.

    json: a JSON schema (dict or JSON string); regex: a regular expression (Rust `regex` syntax);
    choice: a list of strings, the output is one of them; grammar: a Lark or GBNF (llama.cpp) grammar;
    json_object: True for any JSON object. The request finishes ("stop") when the grammar is complete.
    reasoning: a `ReasoningSpan` (core/reasoned.py) for a model that thinks first: its free text comes
    before the constrained answer (vLLM constrains the answer only); None: the constraint starts at once.
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning: ReasoningSpan | None = None
    # a matcher compiled from `llguidance_grammar` for the engine's tokenizer (StructuredOutputs.prepare), or
    # None; each request copies it
    template: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check the fields and compile the grammar; InvalidParam names `structured_outputs.<field>`."""
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidParam("structured_outputs", "structured_outputs needs exactly one of "
                               f"{', '.join(_KINDS)}; got {len(set_)} ({', '.join(set_) or 'none'})")
        kind = set_[0]
        name, v = f"structured_outputs.{kind}", getattr(self, kind)
        ok = {"json": lambda: isinstance(v, (dict, str)), "regex": lambda: isinstance(v, str),
              "grammar": lambda: isinstance(v, str) and v.strip(),
              "choice": lambda: isinstance(v, (list, tuple)) and v and all(isinstance(c, str) and c for c in v),
              "json_object": lambda: v is True}[kind]()
        if not ok:
            want = {"json": "a JSON schema (object or string)", "regex": "a string",
                    "grammar": "a non-empty string", "choice": "a non-empty list of non-empty strings",
                    "json_object": "true"}[kind]
            raise InvalidParam(name, f"{name} must be {want}, got {v!r}"[:300],
                               code="invalid_grammar" if kind == "grammar" else None)
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSpan):
            raise InvalidParam("structured_outputs.reasoning", "structured_outputs.reasoning must be a "
                               f"ReasoningSpan or None, got {type(self.reasoning).__name__}")
        span = self.reasoning
        source = (kind, source_text(kind, v), span)
        if getattr(self, "_source", None) == source:  # compiled already, unchanged since
            return
        grammar = _compile(kind, v, name)
        if span is not None:
            grammar = after_reasoning(grammar, span)
        self._kind, self._grammar, self._source, self.template = kind, grammar, source, None

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def llguidance_grammar(self) -> str:
        return self._grammar


def source_text(kind: str, v) -> str:
    """The text of a constraint as llguidance reads it (its size is what `--max-grammar-bytes` bounds): a
    JSON schema serialized, a regex or grammar as given, the choices' JSON list."""
    if kind == "json":
        return v if isinstance(v, str) else json.dumps(v)
    if kind == "choice":
        return json.dumps(list(v))
    return v if isinstance(v, str) else ""


def _compile(kind: str, v, name: str) -> str:
    import llguidance
    try:
        if kind == "json_object":
            g = llguidance.grammar_from("json_schema", '{"type": "object"}')
        elif kind == "json":
            g = llguidance.grammar_from("json_schema", v if isinstance(v, str) else json.dumps(v))
        elif kind == "choice":
            g = llguidance.grammar_from("choice", list(v))
        else:
            g = llguidance.grammar_from(kind, v)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g)
    except (ValueError, TypeError, RecursionError) as e:
        is_error, messages = True, [str(e)]
    if is_error:
        raise InvalidParam(name, f"invalid {name}: {messages[0] if messages else 'rejected'}".strip()[:2000],
                           "invalid_grammar")
    return g


class StructuredOutputs:
    """The matchers of the constrained requests and the step's bitmask (see the module docstring)."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, max_num_seqs: int, eos_token_ids=()):
        self.tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, sorted(eos_token_ids)
        self.words = -(-vocab_size // 32)
        self._lltok = None
        self._lock = threading.Lock()  # prepare() runs in worker threads, beside the engine thread
        self._executor = None  # llguidance's thread pool: fills the rows of several slots in parallel
        self._templates: dict[str, object] = {}  # grammar -> a fresh matcher to copy (compiled once)
        self._matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> [matcher, n]
        self._mask = np.full((max_num_seqs, self.words), -1, np.int32)  # [S, W]
        self._dirty: list[int] = []  # rows of _mask filled last step
        self.all_ones = self._mask.copy()  # [S, W]; the runner may replace it by a device copy
        self._allowed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> allowed_token_ids row
        self.mask_seconds = 0.0  # host time spent advancing matchers and filling masks, since start
        self.num_masks = 0

    def _tokenizer(self):
        with self._lock:
            return self._tokenizer_locked()

    def _tokenizer_locked(self):
        if self._lltok is None:
            import llguidance
            try:
                if self.tokenizer_json is None:
                    raise ValueError("the model has no tokenizer.json")
                with open(self.tokenizer_json) as f:
                    self._lltok = llguidance.LLTokenizer(f.read(), n_vocab=self.vocab_size,
                                                         eos_token=self.eos or None)
            except Exception as e:  # noqa: BLE001 -- llguidance refuses some tokenizers (e.g. no decoder)
                self._lltok = InvalidParam("structured_outputs", "structured outputs are not available for "
                                           f"this model: llguidance cannot use its tokenizer ({e})",
                                           "structured_outputs_unsupported")
        if isinstance(self._lltok, InvalidParam):
            raise self._lltok
        return self._lltok

    def check(self, params) -> None:
        """Raise InvalidParam if `params` constrain the output and this model's tokenizer cannot."""
        if params.structured_outputs is not None:
            self._tokenizer()

    def prepare(self, params: StructuredOutputsParams) -> None:
        """Compile `params`' matcher for this model's tokenizer (its `template`; llguidance compiles with the
        GIL released): call it from a worker thread before `add_request`, so that the engine thread only
        copies it. Raise InvalidParam if the tokenizer cannot be used or the matcher refuses the grammar (a
        library limit the grammar-only check did not meet). The first mask still runs on the engine thread,
        at the request's first step: llguidance builds its lexer lazily there, bounded by its own limits (a
        copy filled here first would spend the lexer's shared budget of expressions and fail the requests')."""
        import llguidance
        if params.template is not None:
            return
        m = llguidance.LLMatcher(self._tokenizer(), params.llguidance_grammar, log_level=0)
        if m.is_error():
            name = f"structured_outputs.{params.kind}"
            raise InvalidParam(name, f"invalid {name}: {m.get_error()}"[:2000], "invalid_grammar")
        params.template = m

    def _matcher(self, req, end: int | None = None) -> list:
        """[matcher, number of output tokens consumed], caught up with the request's output tokens (those
        before index `end` of its token ids, when given)."""
        entry = self._matchers.get(req)
        if entry is None:
            import llguidance
            so = req.params.structured_outputs
            grammar = so.llguidance_grammar
            template = self._templates.pop(grammar, None)  # re-inserted: the dict is kept in LRU order
            template = so.template if template is None else template
            if template is None:  # not prepared (a Python caller): compiled here, once per grammar
                template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            self._templates[grammar] = template
            if len(self._templates) > 64:
                del self._templates[next(iter(self._templates))]
            entry = self._matchers[req] = [template.deep_copy(), 0]
        m, n = entry
        new = req.token_ids[req.num_prompt_tokens + n:end]
        if new:
            m.consume_tokens(new)
            entry[1] += len(new)
        return entry

    def matcher(self, req):
        """The request's matcher, caught up with its output tokens (speculative decoding consumes its
        proposals and rolls them back: spec_decode/controls.py)."""
        return self._matcher(req)[0]

    def allowed(self, req) -> np.ndarray:
        """The bitmask row i32[W] of the request's allowed_token_ids."""
        row = self._allowed.get(req)
        if row is None:
            row = self._allowed[req] = allowed_row(req.params.allowed_token_ids, self.words)
        return row

    def is_complete(self, req, length: int | None = None) -> bool:
        """After the request's first `length` tokens (default: all): does the grammar end here (no further
        token allowed), or did the output leave it (a token no mask allowed, e.g. forced by min_tokens)?
        Either finishes the request."""
        if req.params.structured_outputs is None:
            return False
        m = self._matcher(req, length)[0]
        return m.is_stopped() or m.is_error()

    def bitmask_arrays(self, scheduled, S: int) -> dict:
        """`bitmask` i32[S, W] and `any_mask` bool[] for one step's scheduled (request, tokens) pairs:
        rows of constrained requests that sample this step hold their matcher's allowed tokens, ANDed with
        their `allowed_token_ids` (SamplingParams) if set (a speculating request's row is its first
        position's; the others: spec_decode/controls.py)."""
        todo = [req for req, n in scheduled if (req.params.structured_outputs is not None
                                                 or req.params.allowed_token_ids is not None)
                and req.num_computed_tokens + n == len(req.token_ids) + len(req.spec_token_ids)]
        if not todo:
            return dict(bitmask=self.all_ones, any_mask=np.bool_(False))
        mask = self._mask
        for s in self._dirty:
            mask[s] = -1
        self._dirty = [req.slot for req in todo]
        grammar = [r for r in todo if r.params.structured_outputs is not None]
        if grammar:
            self._tokenizer()  # built once (~0.4 s), not counted as mask work
            t0 = time.perf_counter()
            import llguidance.numpy as lln
            if len(grammar) == 1:
                lln.fill_next_token_bitmask(self._matcher(grammar[0])[0], mask, grammar[0].slot)
            else:
                if self._executor is None:
                    import llguidance
                    self._executor = llguidance.LLExecutor()
                lln.fill_next_token_bitmask_par(self._executor, [(self._matcher(r)[0], r.slot) for r in grammar],
                                                mask)
            self.mask_seconds += time.perf_counter() - t0
        for r in todo:  # allowed_token_ids: the row of the allowed set (ANDed with the grammar's)
            if r.params.allowed_token_ids is not None:
                mask[r.slot] &= self.allowed(r)
        self.num_masks += len(todo)
        # a copy: the step may still read this one (CPU inputs can alias host memory) when the next is filled
        return dict(bitmask=mask.copy(), any_mask=np.bool_(True))
