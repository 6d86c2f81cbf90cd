"""The OpenAPI 3.1 document: the contract of the server.

Built from the pydantic models of `serve/protocol.py`, then completed with what depends on the served
model and the server: the bounds marked with `limit` (vocabulary, max_model_len, max_logprobs), the
model name, the rules that tie fields together (`if`/`then`), and the bearer scheme only when an API key
is set. The few rules JSON Schema cannot state (they depend on tokenization, compare two fields, or
measure the whole body or field: nesting depth, the stop strings' total length, a constraint's size) are
listed per operation under `x-request-rules`, each with the `code` of its 400.
"""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from jaxpaged.core.sampling_params import MAX_STOP_CHARS
from serve.batch_chat import BatchChatCompletionRequest
from serve.body import MAX_JSON_DEPTH
from serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from serve.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from serve.tools import DEFAULT_MAX_GRAMMAR_BYTES

# 400s for schema-valid requests: the rules JSON Schema cannot express, by error code.
_COMMON_RULES = [
    {"code": "nested_too_deeply", "rule": f"the JSON body nests arrays and objects at most {MAX_JSON_DEPTH} "
     "levels deep (the body itself is level 1)"},
    {"code": "stop_too_long", "rule": f"the stop strings together have at most {MAX_STOP_CHARS} characters"},
    {"code": "context_length_exceeded", "rule": "prompt tokens + max_tokens (default: the rest of "
     "max_model_len) must not exceed max_model_len"},
    {"code": "context_length_exceeded", "rule": "a prompt (or rendered conversation) longer in characters than "
     "(max_model_len - 1) times the most bytes one token stands for is refused before it is tokenized"},
    {"code": "invalid_combination", "rule": "min_tokens must not exceed max_tokens"},
    {"code": "invalid_combination", "rule": "logprob_token_ids need logprobs (chat: logprobs true; an if/then here "
     "would be one too many for schemathesis' generator)"},
    {"code": "invalid_grammar", "rule": "a JSON schema, regex or grammar (structured_outputs, "
     "response_format, tool parameters when tool_choice is required or named) must be one llguidance "
     "compiles (its message says why: syntax, unsupported schema features)"},
    {"code": "invalid_token_id", "rule": "logit_bias keys must be token ids below the vocabulary size"},
    {"code": "structured_outputs_unsupported", "rule": "constrained output (structured_outputs, a non-text "
     "response_format, tool_choice required or named) needs a tokenizer llguidance can read"},
    {"code": "routed_experts_unsupported", "rule": "return_routed_experts needs a mixture-of-experts model "
     "(Mixtral, Qwen3-MoE, OLMoE)"},
]
_BEAM_RULE = {"code": "invalid_combination", "rule": "use_beam_search true: n (the beam width) at most "
              "max_logprobs / 2; no logprobs / top_logprobs, prompt_logprobs, return_routed_experts, "
              "structured_outputs, non-text response_format or tools; max_tokens at least 1"}
COMPLETION_RULES = _COMMON_RULES + [_BEAM_RULE] + [
    {"code": "empty_prompt", "rule": "every prompt must have at least one token once tokenized "
     "(a string of only whitespace may have none)"},
    {"code": "invalid_combination", "rule": "best_of must equal n"},
    {"code": "invalid_combination", "rule": "return_routed_experts needs stream false and one prompt"},
    {"code": "empty_prompt", "rule": "a completion needs prompt or prompt_embeds (given both, the embeddings' "
     "prompts and choices come first)"},
    {"code": "invalid_prompt_embeds", "rule": "prompt_embeds need the server's --enable-prompt-embeds; each is the "
     "base64 of a torch.save'd dense floating-point tensor [prompt_len, hidden_size] (a leading axis of 1 is "
     "dropped) with the model's hidden size and at least one position"},
    {"code": "context_length_exceeded", "rule": "prompt_embeds positions + max_tokens must not exceed "
     "max_model_len"},
    {"code": "invalid_combination", "rule": "prompt_embeds cannot be combined with echo or prompt_logprobs"},
]
CHAT_RULES = _COMMON_RULES + [_BEAM_RULE] + [
    {"code": "chat_template_error", "rule": "the model's chat template may refuse a conversation "
     "(its message says why)"},
    {"code": "invalid_combination", "rule": "at most one of structured_outputs, a non-text response_format "
     "and tool_choice required or named; tool_choice other than none needs tools; a named tool_choice "
     "must name one of the tools"},
    {"code": "invalid_combination", "rule": "return_routed_experts needs stream false"},
    {"code": "invalid_combination", "rule": "continue_final_message needs add_generation_prompt false (an "
     "if/then here would be one too many for schemathesis' generator)"},
    {"code": "empty_prompt", "rule": "truncate_prompt_tokens must leave at least one token of the rendered "
     "conversation (0, or -1 with max_tokens filling max_model_len, leave none)"},
]
BATCH_CHAT_RULES = [r for r in CHAT_RULES if "return_routed_experts" not in r["rule"]]
INVOCATIONS_RULES = COMPLETION_RULES + [r for r in CHAT_RULES if r not in COMPLETION_RULES]
TOKENIZE_RULES = [r for r in CHAT_RULES if r["code"] in ("nested_too_deeply", "chat_template_error")] + [
    {"code": "context_length_exceeded", "rule": "a prompt (or rendered conversation) longer in characters than "
     "(max_model_len - 1) times the most bytes one token stands for is refused before it is tokenized"}]


def _if_then(if_props: dict, then_props: dict, required: list[str], then_required=()) -> dict:
    then = {"properties": then_props}
    if then_required:
        then["required"] = list(then_required)
    return {"if": {"properties": if_props, "required": required}, "then": then}


def _sampling_rules(limits: dict) -> list[dict]:
    """min_tokens > 0 bans EOS (unless ignore_eos) and stop_token_ids; the step holds a fixed number."""
    nb, eos = limits["max_banned_ids"], limits["num_eos_ids"]

    def at_most(k):
        return {"stop_token_ids": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": max(k, 0)}]}}
    return [_if_then({"min_tokens": {"minimum": 1}}, at_most(nb), ["min_tokens"]),
            _if_then({"min_tokens": {"minimum": 1}, "ignore_eos": {"const": False}}, at_most(nb - eos),
                     ["min_tokens"]),
            _if_then({"stream_options": {"type": "object"}}, {"stream": {"const": True}}, ["stream_options"],
                     ["stream"]),
            _if_then({"prompt_logprobs": {"type": "integer"}}, {"stream": {"const": False}}, ["prompt_logprobs"])]


def _fill_limits(node, values: dict) -> None:
    """Replace each `x-limit` marker by the bound it names."""
    if isinstance(node, dict):
        kind = node.pop("x-limit", None)
        if kind is not None:
            node["maximum"] = min(values[kind], node.get("maximum", values[kind]))
        for v in node.values():
            _fill_limits(v, values)
    elif isinstance(node, list):
        for v in node:
            _fill_limits(v, values)


def _grammar_rule(max_bytes: int) -> dict:
    return {"code": "grammar_too_large", "rule": f"an output constraint's text is at most {max_bytes} bytes "
            "(--max-grammar-bytes), measured before it is compiled: a JSON schema (structured_outputs.json, "
            "response_format.json_schema.schema, a named tool's parameters) serialized, a regex or grammar as "
            "given, the choices as a JSON list; for tool_choice required, the one schema of all the tools' "
            "parameters"}


def openapi_schema(version: str, *, limits: dict, model_name: str, api_key: bool,
                   tokenizer_info: bool = False, max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> dict:
    """The OpenAPI 3.1 document of a server over a model with `limits` (LLMEngine.request_limits());
    `tokenizer_info`: GET /tokenizer_info is served (--enable-tokenizer-info-endpoint); `max_grammar_bytes`:
    the server's --max-grammar-bytes."""
    models = [CompletionRequest, ChatCompletionRequest, BatchChatCompletionRequest, CompletionResponse,
              ChatCompletionResponse, ChatCompletionChunk, ModelList, ErrorResponse, TokenizeCompletionRequest,
              TokenizeChatRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, VersionResponse]
    _, defs = models_json_schema([(m, "validation") for m in models],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    L = limits["max_model_len"]
    _fill_limits(schemas, {"token_id": limits["vocab_size"] - 1, "top_k": limits["vocab_size"],
                           "max_model_len": L, "max_tokens": L - 1, "logprobs": limits["max_logprobs"]})
    for name in ("CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest",
                 "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}],
                                                "default": None, "description": "the served model name"}
    for kind in ("regex", "grammar"):  # a text of more characters has more bytes (the rule below is exact)
        schemas["StructuredOutputs"]["properties"][kind]["maxLength"] = max_grammar_bytes
    for name in ("CompletionRequest", "ChatCompletionRequest", "BatchChatCompletionRequest"):
        schemas[name]["allOf"] = _sampling_rules(limits)
        schemas[name]["properties"]["logit_bias"]["anyOf"][0]["additionalProperties"] = False  # keys: digits only
    schemas["CompletionRequest"]["allOf"].append(
        _if_then({"max_tokens": {"const": 0}}, {"echo": {"const": True}}, ["max_tokens"], ["echo"]))
    for name in ("ChatCompletionRequest", "BatchChatCompletionRequest"):
        schemas[name]["allOf"].append(_if_then({"top_logprobs": {"type": "integer"}}, {"logprobs": {"const": True}},
                                               ["top_logprobs"], ["logprobs"]))

    schemas["InvocationsRequest"] = {"anyOf": [{"$ref": "#/components/schemas/ChatCompletionRequest"}, {"allOf": [
        {"$ref": "#/components/schemas/CompletionRequest"}, {"not": {"required": ["messages"]}},
        {"anyOf": [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}]}]}]}
    for name, kinds in (("InvocationsResponse", ("ChatCompletionResponse", "CompletionResponse")),
                        ("InvocationsChunk", ("ChatCompletionChunk", "CompletionResponse"))):
        schemas[name] = {"anyOf": [{"$ref": f"#/components/schemas/{k}"} for k in kinds]}
    security = {"security": [{"bearer": []}]} if api_key else {}

    def ref(name):
        return {"$ref": f"#/components/schemas/{name}"}

    def body(name):
        return {"application/json": {"schema": ref(name)}}

    errors = {str(c): {"description": d, "content": body("ErrorResponse")} for c, d in (
        (400, "invalid request (`param` names the field)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "request body too large"),
        (500, "the step running the request failed (the message has an error id, also logged)"),
        (503, "waiting queue full (see Retry-After) or engine down"))}
    if not api_key:
        del errors["401"]

    def events(chunk):  # one server-sent event: its data is a JSON chunk, an error body, or [DONE]
        return {"type": "object", "required": ["data"], "properties": {"data": {
            "description": f"a {chunk} object, an ErrorResponse object (the stream failed), or [DONE]",
            "anyOf": [{"const": "[DONE]"}, {
                "type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [ref(chunk), ref("ErrorResponse")]}}]}}}

    def generate(summary, request, response, chunk, rules):
        """A generation route; `chunk` None: never streamed."""
        rules = rules + [_grammar_rule(max_grammar_bytes)]
        ok = {"description": "the result", "content": body(response)} if chunk is None else {
            "description": f"the result; with stream=true, server-sent events of {chunk} objects ending in "
                           "`data: [DONE]`",
            "content": {**body(response), "text/event-stream": {"schema": events(chunk)}}}
        return {"post": {
            "summary": summary, **security, "x-request-rules": rules,
            "description": "Beyond the schema, a request is refused (400, with `code`) when: " + "; ".join(
                f"{r['rule']} (`{r['code']}`)" for r in rules) + ".",
            "requestBody": {"required": True, "content": body(request)},
            "responses": {"200": ok, **errors}}}

    doc = {
        "openapi": "3.1.0",
        "info": {"title": "jaxpaged OpenAI-compatible server", "version": version},
        "paths": {
            "/v1/completions": generate("text completion", "CompletionRequest", "CompletionResponse",
                                        "CompletionResponse", COMPLETION_RULES),
            "/v1/chat/completions": generate("chat completion (the model's chat template)",
                                             "ChatCompletionRequest", "ChatCompletionResponse",
                                             "ChatCompletionChunk", CHAT_RULES),
            "/v1/chat/completions/batch": generate(
                "vLLM's batch chat: messages is a list of conversations, answered by one chat completion with one "
                "choice per conversation (index = the conversation's); not streamed, no tools, n 1",
                "BatchChatCompletionRequest", "ChatCompletionResponse", None, BATCH_CHAT_RULES),
            "/invocations": generate("vLLM's (SageMaker's): a body with messages is a chat completion, one "
                                     "with prompt or prompt_embeds (and no messages) a completion",
                                     "InvocationsRequest",
                                     "InvocationsResponse", "InvocationsChunk", INVOCATIONS_RULES),
            "/v1/models": {"get": {"summary": "the served model", **security, "responses": {
                "200": {"description": "model list", "content": body("ModelList")},
                **({"401": errors["401"]} if api_key else {})}}},
            "/health": {"get": {"summary": "200 while the engine serves; 503 once its loop stopped (shut "
                                "down, or too many failed steps in a row)",
                                "responses": {"200": {"description": "healthy"},
                                              "503": {"description": "engine down",
                                                      "content": body("ErrorResponse")}}}},
            "/load": {"get": {"summary": "vLLM's server load: the generation requests in flight (counted with "
                              "--enable-server-load-tracking, else 0)", "responses": {"200": {
                                  "description": "the load", "content": {"application/json": {"schema": {
                                      "type": "object", "required": ["server_load"], "properties": {
                                          "server_load": {"type": "integer", "minimum": 0}}}}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {}}}}}},
            "/tokenize": {"post": {
                "summary": "a prompt's token ids, or a conversation's through the chat template (vLLM's)",
                **security, "x-request-rules": TOKENIZE_RULES,
                "requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
                    ref("TokenizeCompletionRequest"), ref("TokenizeChatRequest")]}}}},
                "responses": {"200": {"description": "the tokens", "content": body("TokenizeResponse")},
                              **{c: errors[c] for c in errors if c in ("400", "401", "404", "413")}}}},
            "/detokenize": {"post": {
                "summary": "token ids -> text (vLLM's)", **security,
                "requestBody": {"required": True, "content": body("DetokenizeRequest")},
                "responses": {"200": {"description": "the text", "content": body("DetokenizeResponse")},
                              **{c: errors[c] for c in errors if c in ("400", "401", "404", "413")}}}},
            "/version": {"get": {"summary": "the server's version", "responses": {
                "200": {"description": "version", "content": body("VersionResponse")}}}},
            **({"/tokenizer_info": {"get": {"summary": "the tokenizer's special tokens, chat template and sizes",
                                            **security, "responses": {
                                                "200": {"description": "tokenizer information",
                                                        "content": {"application/json": {"schema": {
                                                            "type": "object"}}}},
                                                **({"401": errors["401"]} if api_key else {})}}}}
               if tokenizer_info else {}),
        },
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
