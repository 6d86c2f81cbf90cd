"""The protocol of constrained output and tool calling: vLLM's `structured_outputs`, OpenAI's
`response_format`, `tools`, `tool_choice` and the tool calls of responses and stream deltas (pydantic
models; `serve/protocol.py` uses them in its requests and responses, `serve/tools.py` acts on them)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NonEmptyText = Annotated[str, Field(min_length=1)]
_LAX = ConfigDict(allow_inf_nan=False)  # lax, as vLLM's


JsonSchema = dict[str, Any]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False,
                              json_schema_extra={"minProperties": 1, "maxProperties": 1})
    json_: JsonSchema | str = Field(None, alias="json", description="a JSON schema (object or JSON string)")
    regex: str = Field(None, description="a regular expression (Rust regex syntax)")
    choice: list[NonEmptyText] = Field(None, min_length=1, description="the output is one of these")
    grammar: NonEmptyText = Field(None, description="a Lark or GBNF grammar")
    json_object: Literal[True] = Field(None, description="any JSON object")


class TextFormat(BaseModel):
    model_config = _LAX
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _LAX
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema", description="null: any JSON object")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = _LAX
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="a JSON schema of the arguments; null: none")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _LAX
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = _LAX
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction
