"""The protocol of vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages through the chat
template), POST /detokenize, GET /version (pydantic models; `serve/tokenize_routes.py` acts on them)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from serve.protocol import Message, limit

_FIELDS = ConfigDict(extra="ignore", allow_inf_nan=False)  # lax, as vLLM's


class TokenizeCompletionRequest(BaseModel):
    model_config = _FIELDS
    model: str | None = None
    prompt: str = Field(description="the text to tokenize")
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (e.g. BOS) around it")
    return_token_strs: bool = Field(False, description="also the tokens as the vocabulary writes them")


class TokenizeChatRequest(BaseModel):
    model_config = _FIELDS
    model: str | None = None
    messages: list[Message] = Field(min_length=1, description="rendered with the model's chat template")
    add_generation_prompt: bool = Field(True, description="end with the template's assistant prefix")
    continue_final_message: bool = Field(False, description="the last message left open (no end-of-turn), as "
                                         "a chat answer continuing it sees it; not with add_generation_prompt")
    add_special_tokens: bool = Field(False, description="the tokenizer's special tokens too (the template "
                                     "usually writes them)")
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="variables for the chat template "
                                                        "beside messages and tools (vLLM's)")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _FIELDS
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, **limit("token_id"))]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
