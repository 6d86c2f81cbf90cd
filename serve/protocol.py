"""The OpenAI HTTP protocol as pydantic models: requests (validated), responses, stream chunks, errors.

Field names, defaults and ranges follow OpenAI's API, plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens). Unknown fields are
ignored, as OpenAI-compatible servers do; fields we cannot honour (suffix, logit_bias, tools,
response_format) are rejected by the routes when set.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import models_json_schema

MAX_LOGPROBS = 20

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model name; may be omitted")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top-N logprobs per token")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


# -- responses ---------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReason = Literal["stop", "length", "abort"] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    """A completion, or (with object "text_completion" as well) one chunk of a streamed one."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxpaged"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- OpenAPI -----------------------------------------------------------------------------------
def openapi_schema(version: str) -> dict:
    """The OpenAPI 3.1 document of the server, built from the models above."""
    models = [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse,
              ChatCompletionChunk, ModelList, ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in models],
                                 ref_template="#/components/schemas/{model}")

    def ref(name):
        return {"$ref": f"#/components/schemas/{name}"}

    def body(name):
        return {"application/json": {"schema": ref(name)}}

    errors = {str(c): {"description": d, "content": body("ErrorResponse")} for c, d in (
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "request body too large"), (503, "waiting queue full (see Retry-After) or engine down"))}

    def generate(summary, request, response, chunk):
        return {"post": {
            "summary": summary, "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": body(request)},
            "responses": {"200": {"description": "the result; with stream=true, server-sent events of "
                                                 f"{chunk} objects ending in `data: [DONE]`",
                                  "content": {**body(response),
                                              "text/event-stream": {"schema": ref(chunk)}}},
                          **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxpaged OpenAI-compatible server", "version": version},
        "paths": {
            "/v1/completions": generate("text completion", "CompletionRequest", "CompletionResponse",
                                        "CompletionResponse"),
            "/v1/chat/completions": generate("chat completion (the model's chat template)",
                                             "ChatCompletionRequest", "ChatCompletionResponse",
                                             "ChatCompletionChunk"),
            "/v1/models": {"get": {"summary": "the served model", "security": [{"bearer": []}], "responses": {
                "200": {"description": "model list", "content": body("ModelList")}}}},
            "/health": {"get": {"summary": "200 while the engine loop runs, 503 otherwise",
                                "responses": {"200": {"description": "healthy"},
                                              "503": {"description": "engine down"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {}}}}}},
        },
        "components": {"schemas": defs["$defs"],
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
