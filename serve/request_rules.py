"""The request rules beyond each field's own type and bounds, in one table: a rule states what a request of
which kinds must satisfy, the field its 400 names and that 400's code. From the table come both the server's
checks (`check`, run on every validated generation request) and the OpenAPI document's statement of them
(serve/openapi.py): a JSON-Schema if/then where the rule has one (`schema`), else an entry of the operation's
`x-request-rules`. A rule the server checks has `broken` and `message`; a rule that can only be checked later
(it needs the prompt's tokens, the compiled grammar, the engine's limits) names where in `where`.

A field's own type, bounds and allowed values are in its pydantic model (serve/protocol.py), which validates
it and writes its schema; the rules here tie fields together or depend on the model and the server.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxpaged.core.sampling_params import MAX_STOP_CHARS
from jaxpaged.core.tokenizer import TEMPLATE_OWN
from serve.body import MAX_JSON_DEPTH
from serve.errors import APIError

# the kinds of request a rule applies to; /invocations takes both COMPLETION's and CHAT's
COMPLETION, CHAT, BATCH_CHAT, TOKENIZE = "completion", "chat", "batch_chat", "tokenize"
RESPONSES = "responses"  # /v1/responses: its request is planned as a chat request (serve/responses.py)
GENERATION = (COMPLETION, CHAT, BATCH_CHAT)
_ALL = GENERATION + (RESPONSES,)  # the body's and the output constraints' rules hold for /v1/responses too
EMBED, SCORE, RERANK = "embed", "score", "rerank"  # with --runner pooling (serve/embeddings.py, scoring_routes.py)
POOLING = (EMBED, SCORE, RERANK)


@dataclass(frozen=True)
class Rule:
    """One request rule. `text`: the rule as the document states it (a function of the server's facts:
    `limits` of the engine and `max_grammar_bytes`); `example`: a body (beside a prompt or messages) that
    breaks it, for the tests."""
    field: str | None  # the field the 400's `param` names (None: the body as a whole)
    code: str | None  # the 400's `code`
    kinds: tuple[str, ...]
    text: str | Callable[[dict], str]
    broken: Callable[[object], bool] | None = None  # the server's check of a validated request
    message: str | Callable[[object], str] | None = None  # the 400's message (with `broken`)
    where: str | None = None  # where a rule the server does not check here is enforced
    schema: Callable[[dict], list[dict]] | None = None  # the rule as if/then schemas (of the facts)
    example: dict | None = None

    def statement(self, facts: dict) -> str:
        return self.text(facts) if callable(self.text) else self.text


def if_then(if_props: dict, then_props: dict, required: list[str], then_required=()) -> dict:
    """A JSON-Schema if/then: when the `required` fields are present with `if_props`, `then_props` hold."""
    then = {"properties": then_props}
    if then_required:
        then["required"] = list(then_required)
    return {"if": {"properties": if_props, "required": required}, "then": then}


def _banned_ids(facts: dict) -> list[dict]:
    """min_tokens > 0 bans EOS (unless ignore_eos) and stop_token_ids; the step holds a fixed number."""
    nb, eos = facts["limits"]["max_banned_ids"], facts["limits"]["num_eos_ids"]

    def at_most(k):
        return {"stop_token_ids": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": max(k, 0)}]}}
    return [if_then({"min_tokens": {"minimum": 1}}, at_most(nb), ["min_tokens"]),
            if_then({"min_tokens": {"minimum": 1}, "ignore_eos": {"const": False}}, at_most(nb - eos), ["min_tokens"])]


def _no_logprobs(req) -> bool:
    """Chat asks logprobs with logprobs true, completions with a number."""
    return req.logprobs is None or req.logprobs is False


def _template_own(req) -> list[str]:
    """The keys of chat_template_kwargs that the render sets itself."""
    return sorted(set(req.chat_template_kwargs or ()) & set(TEMPLATE_OWN))


_CC = (COMPLETION, CHAT)  # batch chat takes neither beam search nor return_routed_experts
RULES: list[Rule] = [
    Rule("stop_token_ids", None, GENERATION, "with min_tokens > 0, the EOS ids (unless ignore_eos) and "
         "stop_token_ids are at most a fixed number", where="jaxpaged/core/validation.py", schema=_banned_ids),
    Rule("stream_options", None, GENERATION, "stream_options only with stream true",
         broken=lambda r: r.stream_options is not None and not r.stream,
         message="stream_options is only allowed when stream is true",
         schema=lambda f: [if_then({"stream_options": {"type": "object"}}, {"stream": {"const": True}},
                                   ["stream_options"], ["stream"])],
         example={"stream_options": {"include_usage": True}}),
    Rule("prompt_logprobs", "invalid_combination", GENERATION, "prompt_logprobs only with stream false",
         broken=lambda r: r.prompt_logprobs is not None and r.stream,
         message="prompt_logprobs are not available when stream is true",
         schema=lambda f: [if_then({"prompt_logprobs": {"type": "integer"}}, {"stream": {"const": False}},
                                   ["prompt_logprobs"])],
         example={"prompt_logprobs": 1, "stream": True}),
    Rule("best_of", "invalid_combination", (COMPLETION,), "best_of must equal n",
         broken=lambda r: r.best_of is not None and r.best_of != r.n,
         message=lambda r: f"best_of ({r.best_of}) must equal n ({r.n}): best-of-n selection is not supported",
         example={"best_of": 2}),
    Rule("max_tokens", None, (COMPLETION,), "max_tokens 0 only with echo true",
         broken=lambda r: r.max_tokens == 0 and not r.echo and not r.use_beam_search,  # beam search: its own 400
         message="max_tokens 0 needs echo=true (it returns the prompt only)",
         schema=lambda f: [if_then({"max_tokens": {"const": 0}}, {"echo": {"const": True}}, ["max_tokens"],
                                   ["echo"])],
         example={"max_tokens": 0}),
    Rule("top_logprobs", None, (CHAT, BATCH_CHAT), "top_logprobs only with logprobs true",
         broken=lambda r: r.top_logprobs is not None and not r.logprobs, message="top_logprobs needs logprobs=true",
         schema=lambda f: [if_then({"top_logprobs": {"type": "integer"}}, {"logprobs": {"const": True}},
                                   ["top_logprobs"], ["logprobs"])],
         example={"top_logprobs": 2}),
    Rule("continue_final_message", "invalid_combination", (CHAT, BATCH_CHAT, TOKENIZE), "continue_final_message needs "
         "add_generation_prompt false (an if/then here would be one too many for schemathesis' generator)",
         broken=lambda r: r.continue_final_message and r.add_generation_prompt,
         message="continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt "
                 "false to continue the last message)",
         example={"continue_final_message": True}),
    Rule("chat_template_kwargs", "invalid_combination", (CHAT, BATCH_CHAT, TOKENIZE), "chat_template_kwargs may "
         f"not set the template variables the request's own fields set ({', '.join(TEMPLATE_OWN)})",
         broken=lambda r: bool(_template_own(r)),
         message=lambda r: f"chat_template_kwargs sets {', '.join(_template_own(r))}: the request's own fields set "
                           "these template variables (messages, tools, add_generation_prompt)",
         example={"chat_template_kwargs": {"add_generation_prompt": False}}),
    Rule(None, "nested_too_deeply", _ALL + (TOKENIZE,), f"the JSON body nests arrays and objects at most "
         f"{MAX_JSON_DEPTH} levels deep (the body itself is level 1)", where="serve/body.py"),
    Rule("stop", "stop_too_long", GENERATION, f"the stop strings together have at most {MAX_STOP_CHARS} characters",
         where="jaxpaged/core/sampling_params.py"),
    Rule("max_tokens", "context_length_exceeded", GENERATION, "prompt tokens + max_tokens (default: the rest of "
         "max_model_len) must not exceed max_model_len", where="jaxpaged/core/validation.py"),
    Rule("prompt", "context_length_exceeded", GENERATION + (TOKENIZE,), "a prompt (or rendered conversation) "
         "longer in characters than (max_model_len - 1) times the most bytes one token stands for is refused before "
         "it is tokenized", where="serve/prompt_size.py"),
    Rule("min_tokens", "invalid_combination", GENERATION, "min_tokens must not exceed max_tokens",
         broken=lambda r: r.max_tokens == 0 and r.min_tokens > 0 and not r.use_beam_search,  # else: the engine
         message=lambda r: f"min_tokens ({r.min_tokens}) exceeds max_tokens (0)", where="jaxpaged/core/validation.py",
         example={"max_tokens": 0, "echo": True, "min_tokens": 1}),
    Rule("logprob_token_ids", "invalid_combination", GENERATION, "logprob_token_ids need logprobs (chat: logprobs "
         "true; an if/then here would be one too many for schemathesis' generator)",
         broken=lambda r: bool(r.logprob_token_ids) and _no_logprobs(r),
         message="logprob_token_ids need logprobs (chat: logprobs true)", example={"logprob_token_ids": [1]}),
    Rule(None, "invalid_grammar", _ALL, "a JSON schema, regex or grammar (structured_outputs, response_format, "
         "tool parameters when tool_choice is required or named) must be one llguidance compiles (its message says "
         "why: syntax, unsupported schema features)", where="jaxpaged/core/structured.py"),
    Rule("logit_bias", "invalid_token_id", GENERATION, "logit_bias keys must be token ids below the vocabulary size",
         where="jaxpaged/core/validation.py"),
    Rule(None, "structured_outputs_unsupported", _ALL, "constrained output (structured_outputs, a non-text "
         "response_format, tool_choice required or named) needs a tokenizer llguidance can read",
         where="jaxpaged/core/structured.py"),
    Rule("return_routed_experts", "routed_experts_unsupported", _CC, "return_routed_experts needs a "
         "mixture-of-experts model (Mixtral, Qwen3-MoE, OLMoE)", where="jaxpaged/step/routed_experts.py"),
    Rule(None, "invalid_combination", _CC, "use_beam_search true: n (the beam width) at most max_logprobs / 2; no "
         "logprobs / top_logprobs, prompt_logprobs, prompt_embeds, return_routed_experts, structured_outputs, non-text "
         "response_format or tools; max_tokens at least 1", where="serve/beam.py"),
    Rule(None, "grammar_too_large", _ALL, lambda f: f"an output constraint's text is at most "
         f"{f['max_grammar_bytes']} bytes (--max-grammar-bytes), measured before it is compiled: a JSON schema "
         "(structured_outputs.json, response_format.json_schema.schema, a named tool's parameters) serialized, a "
         "regex or grammar as given, the choices as a JSON list; for tool_choice required, the one schema of all "
         "the tools' parameters", where="serve/tools.py"),
    Rule("prompt", "empty_prompt", (COMPLETION,), "every prompt must have at least one token once tokenized "
         "(a string of only whitespace may have none)", where="jaxpaged/core/validation.py"),
    Rule("return_routed_experts", "invalid_combination", (COMPLETION,), "return_routed_experts needs stream false "
         "and one prompt", where="serve/outputs.py"),
    Rule("prompt", "empty_prompt", (COMPLETION,), "a completion needs prompt or prompt_embeds (given both, the "
         "embeddings' prompts and choices come first)", where="serve/completions.py"),
    Rule("prompt_embeds", "invalid_prompt_embeds", (COMPLETION,), "prompt_embeds need the server's "
         "--enable-prompt-embeds; each is the base64 of a torch.save'd dense floating-point tensor [prompt_len, "
         "hidden_size] (a leading axis of 1 is dropped) with the model's hidden size and at least one position",
         where="jaxpaged/core/prompt_embeds.py"),
    Rule("prompt_embeds", "context_length_exceeded", (COMPLETION,), "prompt_embeds positions + max_tokens must not "
         "exceed max_model_len", where="jaxpaged/core/prompt_embeds.py"),
    Rule("prompt_embeds", "invalid_combination", (COMPLETION,), "prompt_embeds cannot be combined with echo or "
         "prompt_logprobs", where="serve/completions.py"),
    Rule("messages", "chat_template_error", (CHAT, BATCH_CHAT, TOKENIZE), "the model's chat template may refuse a "
         "conversation (its message says why)", where="serve/chat.py"),
    Rule(None, "invalid_combination", (CHAT, BATCH_CHAT), "at most one of structured_outputs, a non-text "
         "response_format and tool_choice required or named; tool_choice other than none needs tools; a named "
         "tool_choice must name one of the tools", where="serve/tools.py"),
    Rule("return_routed_experts", "invalid_combination", (CHAT,), "return_routed_experts needs stream false",
         where="serve/outputs.py"),
    Rule("truncate_prompt_tokens", "empty_prompt", (CHAT, BATCH_CHAT), "truncate_prompt_tokens must leave at least "
         "one token of the rendered conversation (0, or -1 with max_tokens filling max_model_len, leave none)",
         where="jaxpaged/core/validation.py"),
    Rule("previous_response_id", "previous_response_not_found", (RESPONSES,), "previous_response_id must name a "
         "stored response: one made with store true, not deleted, among the newest --max-stored-responses",
         where="serve/responses.py"),
    Rule("max_output_tokens", "context_length_exceeded", (RESPONSES,), "the rendered conversation's tokens + "
         "max_output_tokens (default: the rest of max_model_len) must not exceed max_model_len",
         where="jaxpaged/core/validation.py"),
    Rule(None, "invalid_combination", (RESPONSES,), "at most one of a non-text text.format and tool_choice required "
         "or a function; tool_choice other than none needs tools; a function tool_choice must name one of the "
         "tools", where="serve/tools.py"),
    Rule("input", "chat_template_error", (RESPONSES,), "the model's chat template may refuse the conversation (its "
         "message says why)", where="serve/chat.py"),
]

RULES += [
    Rule("dimensions", "unsupported_dimensions", (EMBED,), "dimensions is refused: the served model is not a "
         "matryoshka model, its embeddings have their full size only", broken=lambda r: r.dimensions is not None,
         message=lambda r: f"dimensions: {r.dimensions} requested; the served model is not a matryoshka model, so "
         "its embeddings have their full size only", example={"dimensions": 8}),
    Rule("text_1", "invalid_combination", (SCORE,), "text_1 is one text, or a list as long as text_2",
         broken=lambda r: isinstance(r.text_1, list) and len(r.text_1) > 1 and len(r.text_1) != (
             len(r.text_2) if isinstance(r.text_2, list) else 1),
         message="text_1 must be one text or as many texts as text_2", example={"text_1": ["a", "b", "c"]}),
    Rule("input", "too_many_inputs", POOLING, "at most --max-embedding-inputs inputs in one request (texts of "
         "input, text_1 and text_2, query and documents together); the 400 names the first field",
         where="serve/embeddings.py"),
    Rule("input", "empty_prompt", POOLING, "every input must have at least one token once tokenized (a text of "
         "only whitespace may have none); the 400 names the field", where="serve/embeddings.py"),
    Rule("input", "context_length_exceeded", POOLING, "every input has fewer than max_model_len tokens (after "
         "truncate_prompt_tokens); the 400 names the field", where="serve/embeddings.py"),
]


def check(req, kind: str) -> None:
    """The 400 (OpenAI's error body, `param` the rule's field) of the first rule of `kind` that the
    validated request `req` breaks, in the table's order; nothing if it breaks none."""
    for rule in RULES:
        if kind in rule.kinds and rule.broken is not None and rule.broken(req):
            message = rule.message(req) if callable(rule.message) else rule.message
            raise APIError(400, message, param=rule.field, code=rule.code)


def stated(kinds: tuple[str, ...], facts: dict) -> list[dict]:
    """The `x-request-rules` of an operation taking requests of `kinds`: each rule without a schema of its own,
    once, as {"code", "rule"}."""
    return [{"code": r.code, "rule": r.statement(facts)} for r in RULES
            if r.schema is None and any(k in r.kinds for k in kinds)]


def schemas(kind: str, facts: dict) -> list[dict]:
    """The if/then schemas of the rules of `kind` that JSON Schema states (a request schema's `allOf`)."""
    return [s for r in RULES if r.schema is not None and kind in r.kinds for s in r.schema(facts)]
