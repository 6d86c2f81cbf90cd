"""vLLM's tokenizer routes: POST /tokenize and /detokenize, GET /version, and (with
--enable-tokenizer-info-endpoint) GET /tokenizer_info. Tokenizing runs in a worker thread, never on the
event loop, after the prompt's size bound (serve/prompt_size.py)."""
from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve import lora as serve_lora
from serve import prompt_size, request_rules
from serve.chat import chat_prompt
from serve.errors import APIError
from serve.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from serve.routes import check_auth, validated


async def _parse(request: Request, choose):
    st = request.app.state.server
    req = await validated(request, choose)
    serve_lora.resolve(st, req.model)  # an unknown model is a 404, as on the other routes
    tok = st.engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer files", param="model")
    return req, st, tok


async def tokenize(request: Request) -> Response:
    req, st, tok = await _parse(request, lambda d: TokenizeChatRequest if isinstance(d, dict) and "messages" in d
                                else TokenizeCompletionRequest)
    L = st.engine.max_model_len
    if isinstance(req, TokenizeChatRequest):
        request_rules.check(req, request_rules.TOKENIZE)  # a chat's rules (continue_final_message)
        ids = await asyncio.to_thread(chat_prompt, st.engine, req.messages, None, req.add_generation_prompt,
                                      req.add_special_tokens, req.continue_final_message, True,
                                      req.chat_template_kwargs)
    else:
        await prompt_size.check_prompts(tok, [req.prompt], L)  # a prompt too large refused before tokenizing
        ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
    strs = await asyncio.to_thread(tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=L, tokens=ids, token_strs=strs).model_dump())


async def detokenize(request: Request) -> Response:
    req, st, tok = await _parse(request, lambda d: DetokenizeRequest)
    V = st.engine.request_limits()["vocab_size"]
    bad = [t for t in req.tokens if t >= V]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of vocabulary (vocab_size {V})", param="tokens")
    text = await asyncio.to_thread(tok.decode, req.tokens, False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


async def version(request: Request) -> Response:
    from jaxpaged import __version__
    return JSONResponse(VersionResponse(version=__version__).model_dump())


async def tokenizer_info(request: Request) -> Response:
    """What the served tokenizer is: its special tokens, chat template, vocabulary size and max_model_len."""
    check_auth(request)
    st = request.app.state.server
    tok = st.engine.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer files", code="not_found")
    return JSONResponse({**{k: v for k, v in tok.special.items() if v}, "chat_template": tok.chat_template,
                         "vocab_size": len(tok), "model_max_length": st.engine.max_model_len,
                         "tokenizer_class": tok.tokenizer_class})
