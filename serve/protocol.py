"""The OpenAI HTTP protocol as pydantic models: requests (validated), responses, stream chunks, errors.

Field names, defaults and ranges follow OpenAI's API, plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens). Requests are validated
in pydantic's lax mode, as vLLM's are ("5" is 5, 2.0 is 2, "true" is true; 2.5 or "five" for an integer are
refused), with finite numbers and valid Unicode; every constraint is in the schema
(`serve/openapi.py` adds the model-dependent bounds marked with `limit`). Unknown fields are ignored, as
OpenAI-compatible servers do; a field we cannot honour (suffix) is refused by name (it only accepts null).
Structured outputs (`response_format`, vLLM's `structured_outputs`) and chat `tools` are compiled by
llguidance: a schema, regex or grammar it refuses is a 400 with code `invalid_grammar`; one whose text is over
`--max-grammar-bytes` is refused before it is compiled (`grammar_too_large`, serve/tools.py).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from jaxpaged.core.logit_controls import MAX_LOGIT_BIAS
from jaxpaged.core.sampling_params import (
    FLOAT32_MAX,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SEED_END,
    SEED_MIN,
)
from serve.protocol_tools import DeltaToolCall, NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, ToolCall


def limit(kind: str) -> dict:
    """A bound that depends on the served model: `serve.openapi` writes its value into the schema as
    `maximum`; the engine enforces it (`jaxpaged.core.validation.check_request`)."""
    return {"json_schema_extra": {"x-limit": kind}}


# Strings must be valid Unicode: JSON can carry lone surrogates as escapes ("\ud800"); pydantic refuses
# them in every str field (error type string_unicode).
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, **limit("token_id"))]
Float = Annotated[float, Field(le=FLOAT32_MAX)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # a token id written as a JSON object key
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]  # all of them: MAX_STOP_CHARS
_LAX = ConfigDict(allow_inf_nan=False)  # pydantic's lax mode, as vLLM's: "5" -> 5, 2.0 -> 2, "true" -> True


class StreamOptions(BaseModel):
    model_config = _LAX
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="with include_usage: usage (so far) on every chunk")


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, description="the served model name; may be omitted")
    temperature: Float | None = Field(None, ge=0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} strings, {MAX_STOP_CHARS} characters in all")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_END - 1, description="an integer in [-2**63, 2**63) "
                             "(int64); the engine uses seed mod 2**32")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (a string) -> bias added to its logit, in "
        "[-100, 100]; the ids must be below the vocabulary size")
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off; at most the vocabulary size",
                              **limit("top_k"))
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="at most max_tokens", **limit("max_tokens"))
    stop_token_ids: list[TokenId] | None = Field(None, description="with min_tokens > 0, EOS ids (unless "
                                                 "ignore_eos) and these together are at most a fixed number")
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's constrained decoding")
    return_routed_experts: bool = Field(False, description="MoE models, one prompt, not streamed: each token's "
                                        "expert ids per layer (prompt_routed_experts, choices[].routed_experts)")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1,
                                                    description="only these tokens may be sampled")
    return_token_ids: bool | None = Field(None, description="the prompt's token ids (prompt_token_ids) and each "
                                          "choice's (token_ids; streamed: the new ones of each chunk)")
    return_tokens_as_token_ids: bool | None = Field(None, description="logprobs' tokens written as 'token_id:N' "
                                                    "(default: the server's --return-tokens-as-token-ids)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep only N prompt tokens (the last "
                                               "N, or the first with truncation_side right); -1: as many as "
                                               "fit with max_tokens", **limit("max_model_len"))
    truncation_side: Literal["left", "right"] | None = Field(None, description="with truncate_prompt_tokens: "
                                                             "left (default) drops the first tokens")
    use_beam_search: bool | None = Field(None, description="vLLM's beam search: n is the beam width, the n best "
                                         "beams are the choices (docs/server.md)")
    length_penalty: Float = Field(1.0, description="with use_beam_search: a sequence's score is its cumulative "
                                  "logprob / length ** length_penalty")
    logprob_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS,
                                                    description="the logprobs of these ids at every generated "
                                                    "position, beside the sampled token's, in place of the top-N "
                                                    "(needs logprobs)")
    prompt_logprobs: int | None = Field(None, ge=-1, description="top-N logprobs of each prompt token (the "
                                        "response's prompt_logprobs); -1: the whole vocabulary (a 400 unless "
                                        "--max-logprobs covers it); not streamed", **limit("logprobs"))


PromptText = Annotated[list[NonEmptyText], Field(min_length=1)]
Base64 = Annotated[str, Field(min_length=1, json_schema_extra={"contentEncoding": "base64"})]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: NonEmptyText | PromptText | PromptIds | Annotated[list[PromptIds], Field(min_length=1)] | None = Field(
        None, description="a string, a list of strings, a list of token ids, or a list of token-id lists; needed "
        "unless prompt_embeds is given")
    max_tokens: int | None = Field(16, ge=0, description="null: up to max_model_len; 0 (only with echo): "
                                   "no generated token, the prompt's logprobs only", **limit("max_tokens"))
    logprobs: int | None = Field(None, ge=-1, description="top-N logprobs per token (with echo, of the prompt's "
                                 "tokens too); -1: the whole vocabulary, capped by --max-logprobs",
                                 **limit("logprobs"))
    echo: bool = Field(False, description="the prompt before the completion (and its tokens' logprobs)")
    suffix: None = Field(None, description="not supported")
    prompt_embeds: Base64 | list[Base64] | None = Field(
        None, description="vLLM's prompt embeddings (with --enable-prompt-embeds): base64 of a torch.save'd "
        "floating-point tensor [prompt_len, hidden_size], or a list of them; each is a prompt of its own, before "
        "those of prompt (an empty list: none, as vLLM's)")
    best_of: int | None = Field(None, ge=1, le=128, description="must equal n (null: n)")


class TextPart(BaseModel):
    model_config = _LAX
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class ChatMessage(BaseModel):
    """A system, developer or user message."""
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user"]
    content: Content
    name: str | None = None


ROLES = ("system", "developer", "user", "assistant", "tool")


class CustomRoleMessage(BaseModel):
    """A message of another role, passed through to the chat template as it is (as vLLM's)."""
    model_config = ConfigDict(extra="ignore")
    role: Annotated[str, Field(min_length=1, max_length=64, json_schema_extra={"not": {"enum": list(ROLES)}})]
    content: Content
    name: str | None = None


class AssistantTurn(BaseModel):
    """An earlier assistant message: `content`, `tool_calls`, or both."""
    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [
        {"properties": {"content": {"type": ["string", "array"]}}, "required": ["content"]},
        {"properties": {"tool_calls": {"type": "array", "minItems": 1}}, "required": ["tool_calls"]}]})
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolResult(BaseModel):
    """The result of a tool call, for the model."""
    model_config = ConfigDict(extra="ignore")
    role: Literal["tool"]
    content: Content
    tool_call_id: str


def _role(m) -> str:
    role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
    return role if role in ROLES else "custom"


Message = Annotated[Annotated[ChatMessage, Tag("system")] | Annotated[ChatMessage, Tag("developer")]
                    | Annotated[ChatMessage, Tag("user")] | Annotated[AssistantTurn, Tag("assistant")]
                    | Annotated[ToolResult, Tag("tool")] | Annotated[CustomRoleMessage, Tag("custom")],
                    Discriminator(_role)]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens",
                                   **limit("max_tokens"))
    max_completion_tokens: int | None = Field(None, ge=1, description="null: up to max_model_len",
                                              **limit("max_tokens"))
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1, description="needs logprobs: true; -1: the whole vocabulary, "
                                     "capped by --max-logprobs", **limit("logprobs"))
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    response_format: ResponseFormat | None = None
    echo: bool = Field(False, description="the last message's content before the answer, when its role is the "
                       "answer's")
    add_generation_prompt: bool = Field(True, description="end the prompt with the template's assistant header")
    continue_final_message: bool = Field(False, description="the answer continues the last message (open-ended, "
                                         "no end-of-turn); not with add_generation_prompt")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template beside messages and tools, e.g. {\"enable_thinking\": "
        "false} for Qwen3's (vLLM's)")


# -- responses ---------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class Logprob(BaseModel):
    """vLLM's prompt logprob entry: rank 1 is the most likely token (null: outside the top N asked)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, Logprob] | None]  # per prompt token (the first null): token id -> its entry


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
    routed_experts: list | None = None  # [generated - 1, L, k] (return_routed_experts)
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs asked
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: in the choice's first chunk)
    token_ids: list[int] | None = None  # return_token_ids (streamed: this chunk's)


class CompletionResponse(BaseModel):
    """A completion, or (with object "text_completion" as well) one chunk of a streamed one."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_routed_experts: list | None = None  # [prompt tokens, L, k] (return_routed_experts)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"  # the last message's role with add_generation_prompt false
    content: str | None
    reasoning_content: str | None = None  # --reasoning-parser: the text in <think>...</think> (vLLM's older name)
    reasoning: str | None = None  # the same text, vLLM's newer name
    tool_calls: list[ToolCall] | None = []  # None: a named / required call cut before it was whole


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    routed_experts: list | None = None  # [generated - 1, L, k] (return_routed_experts)
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_routed_experts: list | None = None  # [prompt tokens, L, k] (return_routed_experts)
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs asked
    prompt_token_ids: list[int] | None = None  # return_token_ids


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    # --reasoning-parser: the reasoning's new text (and as `reasoning`); absent when there is none, as vLLM's
    # (clients add up `delta.reasoning` wherever it is present)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    reasoning: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # return_token_ids: in the first chunk only; absent from the others (as vLLM's)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxpaged"
    max_model_len: int | None = None
    root: str | None = None    # the base model's path or name as given; a LoRA adapter's directory
    parent: str | None = None  # null for the base model; a LoRA adapter: the base model's name


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
