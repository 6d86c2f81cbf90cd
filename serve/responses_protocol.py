"""The Responses API's protocol (POST /v1/responses) as pydantic models: the request (validated: an `input`
item of an unknown type or shape is a 400 naming it, e.g. `input.1.type`), the response and its output items,
as OpenAI's `openai.types.responses` reads them. serve/responses.py turns a request into a chat conversation."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from jaxpaged.core.sampling_params import FLOAT32_MAX, SEED_END, SEED_MIN
from serve.protocol import limit

_IGNORE = ConfigDict(extra="ignore", allow_inf_nan=False)  # unknown fields ignored, lax as the other routes


class InputText(BaseModel):
    """A text part of an input message (an earlier answer's parts are output_text)."""
    model_config = _IGNORE
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    """A message of the conversation: `{"role", "content"}` (type "message" or omitted)."""
    model_config = _IGNORE
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[InputText], Field(min_length=1)]


class FunctionCallInput(BaseModel):
    """An earlier answer's function call, given back with its result."""
    model_config = _IGNORE
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutput(BaseModel):
    """The result of a function call (`call_id` names the call)."""
    model_config = _IGNORE
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


def _item_type(item) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output") else "message"


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
                      | Annotated[FunctionCallOutput, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    """A function the model may call (OpenAI's flat shape: name beside type)."""
    model_config = _IGNORE
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = _IGNORE
    type: Literal["function"]
    name: str


class FormatText(BaseModel):
    model_config = _IGNORE
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = _IGNORE
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    model_config = _IGNORE
    type: Literal["json_schema"]
    name: str = Field("response", max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _IGNORE
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""
    model_config = _IGNORE
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="a user message's text, or a list of messages, function calls and their outputs")
    instructions: str | None = Field(None, description="a system message before the input (not carried on by "
                                     "previous_response_id)")
    max_output_tokens: int | None = Field(None, ge=1, description="null: up to max_model_len",
                                          **limit("max_tokens"))
    temperature: Annotated[float, Field(ge=0, le=FLOAT32_MAX)] | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_END - 1)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=128, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = Field(None, description="continue a stored response's conversation")
    store: bool = Field(True, description="keep the response for GET and previous_response_id (in memory, the "
                        "newest --max-stored-responses)")
    metadata: dict[str, str] | None = None
    user: str | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = []
    content: list[ReasoningText]
    status: str = "completed"


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """A response as OpenAI's client reads it (`output_text`: its messages' text)."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []  # as the request gave them
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {"format": {"type": "text"}}
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
