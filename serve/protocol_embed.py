"""The protocol of the embedding routes (with `--runner pooling`): OpenAI's POST /v1/embeddings, vLLM's
/pooling, /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank's body); pydantic models that
serve/embeddings.py and serve/scoring_routes.py act on."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve.protocol import limit

_FIELDS = ConfigDict(extra="ignore", allow_inf_nan=False)  # lax, as vLLM's

TokenId = Annotated[int, Field(ge=0, **limit("token_id"))]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# OpenAI's `input`: one text, texts, one token-id list, or token-id lists
Inputs = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    model_config = _FIELDS
    model: str | None = None
    input: Inputs = Field(description="a text, a list of texts, a list of token ids, or a list of such lists; at "
                          "most --max-embedding-inputs of them")
    encoding_format: Literal["float", "base64"] = Field("float", description="float: lists of numbers; base64: "
                                                        "each vector's float32 little-endian bytes in base64")
    dimensions: int | None = Field(None, description="refused (400): the served model is not a matryoshka model")
    user: str | None = None
    normalize: bool | None = Field(None, description="L2-normalize (vLLM's; default: the server's "
                                   "--pooler-config)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, **limit("max_model_len"),
                                               description="keep only the last N tokens of each input; -1: as "
                                               "many as max_model_len allows")


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling body: /v1/embeddings' (the pooled states, under `data`)."""


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class EmbedUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbedUsage


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbedUsage


Texts = Text | Annotated[list[Text], Field(min_length=1)]


class ScoreRequest(BaseModel):
    """vLLM's /score: `text_1` one text (scored against each of `text_2`) or as many as `text_2` (pairwise)."""
    model_config = _FIELDS
    model: str | None = None
    text_1: Texts = Field(description="one text, or a list as long as text_2")
    text_2: Texts = Field(description="the texts text_1 is scored against")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, **limit("max_model_len"))


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbedUsage


class RerankRequest(BaseModel):
    """vLLM's (Jina's / Cohere's) /rerank: the documents ordered by their score against the query."""
    model_config = _FIELDS
    model: str | None = None
    query: Text
    documents: Annotated[list[Text], Field(min_length=1)]
    top_n: int | None = Field(None, ge=0, description="the best N (0 or null: all)")
    return_documents: bool = Field(True, description="each result carries its document's text")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, **limit("max_model_len"))


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
