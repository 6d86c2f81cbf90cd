"""The routes /v1/models, /health, /metrics, /openapi.json and the LoRA adapters'; and the plumbing of the
generation routes (serve/generation.py): auth, body limit, JSON, schema, model name, request rules, sampling
parameters."""
from __future__ import annotations

import hmac

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.sampling_params import SamplingParams
from serve import lora as serve_lora
from serve import outputs as fmt
from serve import request_rules
from serve.body import read_json
from serve.errors import APIError, from_validation_error, from_value_error
from serve.protocol import (
    ModelCard,
    ModelList,
)


# -- request plumbing ---------------------------------------------------------------------------
async def validated(request: Request, choose):
    """Auth, the body (size limit, JSON, nesting depth) and its schema: the request model `choose(data)`
    validated from it; any failure is an APIError."""
    st = request.app.state.server
    check_auth(request)
    data = getattr(request.state, "body", None)  # read already by /invocations
    if data is None:
        data = await read_json(request, st.config.max_body_bytes, st.config.request_body_timeout)
    try:
        return choose(data).model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def parse(request: Request, model_cls, kind: str):
    """`validated`, then the model name and the request rules of `kind` (serve/request_rules.py); any failure
    is an APIError."""
    st = request.app.state.server
    req = await validated(request, lambda data: model_cls)
    request.state.lora = serve_lora.resolve(st, req.model)  # the adapter `model` names (404 if none)
    request_rules.check(req, kind)
    return req


def stream_usage(st, req) -> tuple[bool, bool]:
    """(usage in a last chunk, usage so far on every chunk) of a stream: stream_options.include_usage and,
    with it, stream_options.continuous_usage_stats; --enable-force-include-usage turns both on, as vLLM's."""
    if st.config.enable_force_include_usage:
        return True, True
    so = req.stream_options
    include = bool(so and so.include_usage)
    return include, include and bool(so and so.continuous_usage_stats)


def token_text(st, req) -> fmt.TokenText:
    """Token ids -> logprobs' token strings: 'token_id:N' with return_tokens_as_token_ids (default: the
    server's --return-tokens-as-token-ids)."""
    as_ids = req.return_tokens_as_token_ids
    return fmt.TokenText(st.engine.tokenizer, st.config.return_tokens_as_token_ids if as_ids is None else as_ids)


def check_auth(request: Request) -> None:
    key = request.app.state.server.config.api_key
    if key is None:
        return
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")


def num_logprobs(st, field: str, k: int | None) -> int | None:
    """The logprobs per token a request asks (`field`: logprobs / top_logprobs): -1 is the whole vocabulary,
    capped by --max-logprobs; more than that cap is a 400 naming the field and the cap. prompt_logprobs -1 is
    the whole vocabulary uncapped, as vLLM's: a 400 unless --max-logprobs covers it."""
    if k == -1 and field == "prompt_logprobs":
        vocab = st.engine.request_limits()["vocab_size"]
        if vocab > st.max_logprobs:
            raise APIError(400, f"prompt_logprobs -1 asks every token of the vocabulary ({vocab}), more than "
                                f"max_logprobs ({st.max_logprobs}): the server's --max-logprobs", param=field)
        return vocab
    if k == -1:
        return st.max_logprobs
    if k is not None and k > st.max_logprobs:
        raise APIError(400, f"{field} ({k}) is greater than max_logprobs ({st.max_logprobs}): the server's "
                            "--max-logprobs, capped by the vocabulary size", param=field)
    return k


def shown_logprobs(req, k: int | None) -> int | None:
    """The logprobs each generated token shows: the top `k` (None: none), or with logprob_token_ids (which
    need logprobs asked: serve/request_rules.py) the sampled token's and the ids' (fmt.ALL)."""
    return fmt.ALL if req.logprob_token_ids else k


def sampling_params(req, max_tokens: int | None, logprobs: int | None, rename: dict,
                    structured=None, prompt_logprobs: int | None = None) -> SamplingParams:
    kw = dict(structured_outputs=structured, n=req.n, max_tokens=max_tokens, logprobs=logprobs, stop=req.stop,
              stop_token_ids=req.stop_token_ids,
              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
              prompt_logprobs=prompt_logprobs, return_routed_experts=req.return_routed_experts)
    if req.logit_bias:  # OpenAI's string keys (the schema admits digits only)
        kw["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if req.allowed_token_ids:
        kw["allowed_token_ids"] = req.allowed_token_ids
    if req.logprob_token_ids:
        kw["logprob_token_ids"] = req.logprob_token_ids
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.seed is not None:
        kw["seed"] = req.seed
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise from_value_error(e, rename) from None


# -- the rest ---------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    check_auth(request)
    st = request.app.state.server
    card = ModelCard(id=st.model_name, created=st.created, max_model_len=st.engine.max_model_len,
                     root=st.model_root)
    adapters = [ModelCard(id=name, created=st.created, max_model_len=st.engine.max_model_len, root=lr.lora_path,
                          parent=st.model_name) for name, lr in (st.adapters.by_name.items() if st.adapters else ())]
    return JSONResponse(ModelList(data=[card] + adapters).model_dump())  # the base model's parent: null


async def load_lora_adapter(request: Request) -> Response:
    check_auth(request)
    return await serve_lora.load(request)


async def unload_lora_adapter(request: Request) -> Response:
    check_auth(request)
    return await serve_lora.unload(request)


async def health(request: Request) -> Response:
    if request.app.state.server.engine.is_alive():
        return Response(status_code=200)
    raise APIError(503, "the engine loop is not running", code="engine_unavailable")


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.server.metrics.render()
    return Response(body, media_type=content_type)


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.server.openapi)
