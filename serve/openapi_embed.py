"""The OpenAPI document's part for the embedding routes (with `--runner pooling`): their models and operations,
which serve/openapi.py adds to the document it builds."""
from __future__ import annotations

from serve import request_rules
from serve.protocol_embed import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from serve.request_rules import EMBED, RERANK, SCORE

MODELS = [EmbeddingRequest, EmbeddingResponse, PoolingRequest, PoolingResponse, ScoreRequest, ScoreResponse,
          RerankRequest, RerankResponse]
# path -> (summary, request schema, response schema, the request rules' kind)
ROUTES = {
    "/v1/embeddings": ("OpenAI's embeddings: each input's pooled final-norm hidden state (--pooler-config)",
                       "EmbeddingRequest", "EmbeddingResponse", EMBED),
    "/pooling": ("vLLM's pooling: /v1/embeddings' body, the vectors under `data`", "PoolingRequest",
                 "PoolingResponse", EMBED),
    "/score": ("vLLM's score: the cosine similarity of the embeddings of text_1 and each of text_2",
               "ScoreRequest", "ScoreResponse", SCORE),
    "/v1/score": ("as /score", "ScoreRequest", "ScoreResponse", SCORE),
    "/rerank": ("vLLM's rerank: the documents by the cosine similarity of their embeddings to the query's, best "
                "first", "RerankRequest", "RerankResponse", RERANK),
    "/v1/rerank": ("as /rerank", "RerankRequest", "RerankResponse", RERANK),
    "/v2/rerank": ("as /rerank", "RerankRequest", "RerankResponse", RERANK),
}


def embedding_paths(schemas: dict, model_name: str, facts: dict, security: dict, errors: dict) -> dict:
    """The operations of the embedding routes (`schemas`: the document's, whose request models get the model
    name; `errors`: the error responses by status)."""
    for name in ("EmbeddingRequest", "PoolingRequest", "ScoreRequest", "RerankRequest"):
        schemas[name]["properties"]["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}],
                                                "default": None, "description": "the served model name"}

    def body(name):
        return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}

    paths = {}
    for path, (summary, request, response, kind) in ROUTES.items():
        rules = request_rules.stated((kind,), facts)
        paths[path] = {"post": {
            "summary": summary, **security, "x-request-rules": rules,
            "description": "Beyond the schema, a request is refused (400, with `code`) when: " + "; ".join(
                f"{r['rule']} (`{r['code']}`)" for r in rules) + ".",
            "requestBody": {"required": True, "content": body(request)},
            "responses": {"200": {"description": "the result", "content": body(response)}, **errors}}}
    return paths
