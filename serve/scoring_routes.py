"""vLLM's POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank) for a decoder embedding model (served
with `--runner pooling`): a pair's score is the cosine similarity of the two texts' embeddings (as vLLM scores
with an embedding model; no cross-encoder here). Every text of a request is embedded in one job
(serve/embeddings.py `embed`), so the texts are checked before any runs and scheduled like prompts.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.pooling import cosine, pairs
from serve.embeddings import as_list, embed, keep_tokens
from serve.protocol_embed import (
    EmbedUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from serve.request_rules import RERANK, SCORE
from serve.routes import parse


async def score(request: Request) -> Response:
    """text_1 (one text, or as many as text_2) against text_2: one score per pair, in text_2's order."""
    req = await parse(request, ScoreRequest, SCORE)  # the rules refuse text_1 and text_2 of unequal lengths
    st = request.app.state.server
    t1, t2 = as_list(req.text_1), as_list(req.text_2)
    vectors, tokens, job = await embed(request, "score", {"text_1": t1, "text_2": t2},
                                       keep=keep_tokens(req.truncate_prompt_tokens, st.engine.max_model_len))
    a, b = vectors[:len(t1)], vectors[len(t1):]
    data = [ScoreData(index=k, score=cosine(a[i], b[j])) for k, (i, j) in enumerate(pairs(t1, t2))]
    body = ScoreResponse(id=job.id, created=job.created, model=req.model or st.model_name, data=data,
                         usage=EmbedUsage(prompt_tokens=tokens, total_tokens=tokens))
    job.close(200)
    return JSONResponse(body.model_dump())


async def rerank(request: Request) -> Response:
    """The documents by their score against the query, best first (the top_n best when given)."""
    req = await parse(request, RerankRequest, RERANK)
    st = request.app.state.server
    vectors, tokens, job = await embed(request, "rerank", {"query": [req.query], "documents": req.documents},
                                       keep=keep_tokens(req.truncate_prompt_tokens, st.engine.max_model_len))
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
               for i in order]
    body = RerankResponse(id=job.id, model=req.model or st.model_name, usage=RerankUsage(total_tokens=tokens),
                          results=results)
    job.close(200)
    return JSONResponse(body.model_dump())
