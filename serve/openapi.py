"""The OpenAPI 3.1 document: the contract of the server.

Built from the pydantic models of `serve/protocol.py`, then completed with what depends on the served
model and the server: the bounds marked with `limit` (vocabulary, max_model_len, max_logprobs), the
model name, the request rules of serve/request_rules.py (those JSON Schema states as `if`/`then` in the
request schemas, the rest listed per operation under `x-request-rules`, each with the `code` of its 400), and
the bearer scheme only when an API key is set.
"""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from serve import openapi_embed, request_rules
from serve.batch_chat import BatchChatCompletionRequest
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
from serve.request_rules import BATCH_CHAT, CHAT, COMPLETION, TOKENIZE
from serve.tools import DEFAULT_MAX_GRAMMAR_BYTES

# the request schemas the rules of each kind (serve/request_rules.py) tie together with if/then
_KIND_SCHEMAS = {COMPLETION: "CompletionRequest", CHAT: "ChatCompletionRequest",
                 BATCH_CHAT: "BatchChatCompletionRequest"}


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
                   tokenizer_info: bool = False, max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                   pooling: bool = False) -> dict:
    """The OpenAPI 3.1 document of a server over a model with `limits` (LLMEngine.request_limits());
    `tokenizer_info`: GET /tokenizer_info is served (--enable-tokenizer-info-endpoint); `max_grammar_bytes`:
    the server's --max-grammar-bytes; `pooling`: the embedding routes are served (--runner pooling)."""
    models = [CompletionRequest, ChatCompletionRequest, BatchChatCompletionRequest, CompletionResponse,
              ChatCompletionResponse, ChatCompletionChunk, ModelList, ErrorResponse, TokenizeCompletionRequest,
              TokenizeChatRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, VersionResponse]
    models += openapi_embed.MODELS if pooling else []
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
    facts = {"limits": limits, "max_grammar_bytes": max_grammar_bytes}
    for kind, name in _KIND_SCHEMAS.items():
        schemas[name]["allOf"] = request_rules.schemas(kind, facts)
        schemas[name]["properties"]["logit_bias"]["anyOf"][0]["additionalProperties"] = False  # keys: digits only

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

    def generate(summary, request, response, chunk, kinds):
        """A generation route taking requests of `kinds`; `chunk` None: never streamed."""
        rules = request_rules.stated(kinds, facts)
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
                                        "CompletionResponse", (COMPLETION,)),
            "/v1/chat/completions": generate("chat completion (the model's chat template)",
                                             "ChatCompletionRequest", "ChatCompletionResponse",
                                             "ChatCompletionChunk", (CHAT,)),
            "/v1/chat/completions/batch": generate(
                "vLLM's batch chat: messages is a list of conversations, answered by one chat completion with one "
                "choice per conversation (index = the conversation's); not streamed, no tools, n 1",
                "BatchChatCompletionRequest", "ChatCompletionResponse", None, (BATCH_CHAT,)),
            "/invocations": generate("vLLM's (SageMaker's): a body with messages is a chat completion, one "
                                     "with prompt or prompt_embeds (and no messages) a completion",
                                     "InvocationsRequest",
                                     "InvocationsResponse", "InvocationsChunk", (COMPLETION, CHAT)),
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
                **security, "x-request-rules": request_rules.stated((TOKENIZE,), facts),
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
    _add_responses(doc, generate, errors, security, limits, model_name)
    if pooling:
        doc["paths"].update(openapi_embed.embedding_paths(schemas, model_name, facts, security, errors))
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _add_responses(doc: dict, generate, errors: dict, security: dict, limits: dict, model_name: str) -> None:
    """/v1/responses (a generation route, `generate` its operation) and GET / DELETE /v1/responses/{id}, with
    their schemas (serve/responses_protocol.py)."""
    from serve.request_rules import RESPONSES
    from serve.responses_protocol import DeletedResponse, Response, ResponsesRequest

    _, defs = models_json_schema([(m, "validation") for m in (ResponsesRequest, Response, DeletedResponse)],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    L = limits["max_model_len"]
    _fill_limits(schemas, {"max_tokens": L - 1})
    schemas["ResponsesRequest"]["properties"]["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}],
                                                          "default": None, "description": "the served model name"}
    schemas["ResponseStreamEvent"] = {"type": "object", "required": ["type", "sequence_number"], "properties": {
        "type": {"type": "string", "description": "response.created, response.output_text.delta, ..."},
        "sequence_number": {"type": "integer", "minimum": 0}}}
    doc["components"]["schemas"].update(schemas)
    found = {"description": "the stored response", "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Response"}}}}
    missing = {"description": "no stored response of that id", "content": errors["404"]["content"]}
    param = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    doc["paths"]["/v1/responses"] = generate(
        "OpenAI's Responses API: the input (a text, or messages, function calls and their outputs) after the "
        "stored conversation of previous_response_id, answered as chat answers it; streamed as typed events",
        "ResponsesRequest", "Response", "ResponseStreamEvent", (RESPONSES,))
    doc["paths"]["/v1/responses/{response_id}"] = {
        "get": {"summary": "a stored response", **security, "parameters": param,
                "responses": {"200": found, "404": missing}},
        "delete": {"summary": "forget a stored response", **security, "parameters": param, "responses": {
            "200": {"description": "deleted", "content": {"application/json": {"schema": {
                "$ref": "#/components/schemas/DeletedResponse"}}}}, "404": missing}}}
