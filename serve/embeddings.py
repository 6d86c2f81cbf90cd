"""POST /v1/embeddings (OpenAI's) and /pooling (vLLM's), served with `--runner pooling`: each input's pooled
final-norm hidden state (jaxpaged/core/pooling.py, jaxpaged/step/pooling.py).

Every input is checked before any runs: the number of inputs (at most --max-embedding-inputs), each one's
shape (a text, token ids; 400 naming `input`), tokens and length; then one engine request per input, all of
one `Job` (serve/job.py), so they are scheduled like prompts, aborted if the client goes away, and recorded
in the metrics. `embed` is shared with /score and /rerank (serve/scoring_routes.py).
"""
from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.pooling import PoolingParams
from jaxpaged.core.sampling_params import SamplingParams
from serve.errors import APIError
from serve.job import Job, run_to_end
from serve.prompts import completion_prompts
from serve.protocol_embed import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbedUsage,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
)
from serve.request_rules import EMBED
from serve.routes import parse


def as_list(value) -> list:
    """OpenAI's `input` as a list of inputs: one text or token-id list, or a list of them."""
    return [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)


def keep_tokens(n: int | None, max_model_len: int) -> int | None:
    """truncate_prompt_tokens: None (keep all), N, or -1 (as many as fit: max_model_len - 1)."""
    return None if n is None else max_model_len - 1 if n == -1 else n


async def embed(request: Request, prefix: str, inputs: dict[str, list], normalize: bool | None = None,
                keep: int | None = None) -> tuple[list[np.ndarray], int, Job]:
    """Each input's vector f32[D] (inputs by the request field they came in, in order), the prompt tokens in
    all, and the finished job (closed by the caller with its HTTP status). Any bad input is a 400 naming its
    field before anything runs."""
    st = request.app.state.server
    count = sum(len(v) for v in inputs.values())
    if count > st.config.max_embedding_inputs:
        field = next(iter(inputs))
        raise APIError(400, f"{field}: {count} inputs in one request; the limit is {st.config.max_embedding_inputs} "
                       "(--max-embedding-inputs)", param=field, code="too_many_inputs")
    L = st.engine.max_model_len
    prompts = []
    for field, items in inputs.items():
        try:
            got = await completion_prompts(st.engine, items, keep, "left")
        except APIError as e:  # its checks name the completions' field
            raise APIError(e.status, e.message.replace("prompt", field, 1), param=field, code=e.code) from None
        for p in got:
            ids = p["prompt_token_ids"] if isinstance(p, dict) else p
            if len(ids) >= L:  # the engine's rule for one token after the prompt, named here by field
                raise APIError(400, f"{field}: an input of {len(ids)} tokens; max_model_len is {L} (at most "
                               f"{L - 1} tokens)", param=field, code="context_length_exceeded")
            if not ids:
                raise APIError(400, f"{field}: an input has no tokens", param=field, code="empty_prompt")
        prompts += got
    config = st.engine.engine.config
    params = SamplingParams(max_tokens=1, temperature=0.0,
                            pooling=PoolingParams(normalize=normalize).resolve(config.pooler_config))
    job = Job(request, prefix, {"prompt": next(iter(inputs))})
    await job.start(prompts, params, stream=False)
    if not await run_to_end(job):
        raise APIError(499, "the client disconnected", code="client_disconnected")
    return [o.pooled for o in job.lasts], sum(len(o.prompt_token_ids) for o in job.lasts), job


def encoded(v: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as the request asks: a list of floats, or base64 of its float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


async def _pooled(request: Request, model, prefix: str):
    req = await parse(request, model, EMBED)  # the request rules refuse `dimensions`
    st = request.app.state.server
    vectors, tokens, job = await embed(request, prefix, {"input": as_list(req.input)}, req.normalize,
                                       keep_tokens(req.truncate_prompt_tokens, st.engine.max_model_len))
    head = dict(id=job.id, created=job.created, model=req.model or st.model_name,
                usage=EmbedUsage(prompt_tokens=tokens, total_tokens=tokens))
    return req, vectors, head, job


async def embeddings(request: Request) -> Response:
    req, vectors, head, job = await _pooled(request, EmbeddingRequest, "embd")
    body = EmbeddingResponse(data=[EmbeddingData(index=i, embedding=encoded(v, req.encoding_format))
                                   for i, v in enumerate(vectors)], **head)
    job.close(200)
    return JSONResponse(body.model_dump())


async def pooling(request: Request) -> Response:
    req, vectors, head, job = await _pooled(request, PoolingRequest, "pool")
    body = PoolingResponse(data=[PoolingData(index=i, data=encoded(v, req.encoding_format))
                                 for i, v in enumerate(vectors)], **head)
    job.close(200)
    return JSONResponse(body.model_dump())
