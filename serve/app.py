"""The Starlette app (`create_app`) and `jaxpaged serve` (`add_serve_args`, `run_server`), both from one
`ServerConfig` (serve/config.py).

    engine = AsyncEngine(LLMEngine(EngineConfig(model=DIR)), max_waiting=512)
    app = create_app(engine, ServerConfig(served_model_name="my-model", api_key=None))
    uvicorn.run(app)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from jaxpaged.args import add_engine_args, engine_config
from jaxpaged.async_engine import AsyncEngine
from serve import batch_chat, chat, completions, invocations, responses, rl_routes, routes, tokenize_routes
from serve import lora as serve_lora
from serve.config import DEFAULT_MAX_BODY_BYTES, ServerConfig, add_server_args
from serve.embeddings import embeddings, pooling
from serve.errors import APIError
from serve.http_protocol import protocol
from serve.load import Load, counted, server_load
from serve.metrics import Metrics
from serve.openapi import openapi_schema
from serve.reasoning import ReasoningParser, make_parser
from serve.responses_store import ResponseStore
from serve.scoring_routes import rerank, score
from serve.tool_parsers import HermesParser, ToolParser, make_tool_parser

log = logging.getLogger("jaxpaged.serve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHUTDOWN_FLUSH = 5.0  # seconds after --shutdown-timeout for the final events to reach clients


@dataclass
class ServerState:
    """What the routes share (`request.app.state.server`): the engine, the config, and what the app made."""
    engine: AsyncEngine
    config: ServerConfig
    model_name: str  # config.served_model_name, or the default model's name
    model_root: str  # /v1/models' `root` of the base model: config.model_root, or the name
    metrics: Metrics
    openapi: dict
    created: int
    max_logprobs: int  # the most logprobs per token a request may ask (-1 asks this many)
    reasoning: ReasoningParser  # --reasoning-parser (default: none)
    load: Load  # GET /load (counted with --enable-server-load-tracking)
    adapters: serve_lora.Adapters | None = None  # LoRA adapters by name (--enable-lora)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set when --shutdown-timeout expires
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))  # /v1/responses' stored responses
    tool_parser: ToolParser = field(default_factory=HermesParser)  # --tool-call-parser (tool_choice auto)


def create_app(engine: AsyncEngine, config: ServerConfig | None = None, *, adapters: serve_lora.Adapters | None = None,
               shutdown_engine: bool = True, **overrides) -> Starlette:
    """The OpenAI-compatible app over `engine`, served as `config` says (serve/config.py: each field's
    help; `overrides`: ServerConfig fields replaced, e.g. `create_app(engine, served_model_name="m")`).
    `adapters`: the LoRA adapters already added to the engine, by name (requests pick one by `model`);
    `shutdown_engine`: the app's shutdown shuts the engine down too."""
    from jaxpaged import __version__

    config = dataclasses.replace(config or ServerConfig(), **overrides)
    name = config.served_model_name or DEFAULT_MODEL_NAME

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown)

    app = Starlette(routes=[
        Route("/v1/completions", counted(completions.completions), methods=["POST"]),
        Route("/v1/chat/completions", counted(chat.chat_completions), methods=["POST"]),
        Route("/v1/chat/completions/batch", counted(batch_chat.batch_chat_completions), methods=["POST"]),
        Route("/invocations", counted(invocations.invocations), methods=["POST"]),
        Route("/v1/responses", counted(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.stored, methods=["GET", "DELETE"]),
        Route("/load", server_load, methods=["GET"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/openapi.json", routes.openapi, methods=["GET"]),
        Route("/pause", rl_routes.pause, methods=["POST"]),
        Route("/resume", rl_routes.resume, methods=["POST"]),
        Route("/is_paused", rl_routes.is_paused, methods=["GET"]),
        Route("/tokenize", tokenize_routes.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize_routes.detokenize, methods=["POST"]),
        Route("/version", tokenize_routes.version, methods=["GET"]),
    ] + ([Route("/tokenizer_info", tokenize_routes.tokenizer_info, methods=["GET"])]
         if config.enable_tokenizer_info_endpoint else [])
      + ([Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
          Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"])]
         if config.enable_runtime_lora_updating else [])
      + (embedding_routes() if engine.engine.config.pooling else []),
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan)
    limits = engine.request_limits()
    schema = openapi_schema(__version__, limits=limits, model_name=name, max_grammar_bytes=config.max_grammar_bytes,
                            api_key=bool(config.api_key), tokenizer_info=config.enable_tokenizer_info_endpoint,
                            pooling=engine.engine.config.pooling)
    if adapters is None and config.enable_runtime_lora_updating:
        adapters = serve_lora.Adapters()
    app.state.server = ServerState(engine, dataclasses.replace(config, api_key=config.api_key or None), name,
                                   config.model_root or name, Metrics(engine, name, limits["max_model_len"]),
                                   schema, int(time.time()), limits["max_logprobs"],
                                   make_parser(config.reasoning_parser), Load(config.enable_server_load_tracking),
                                   adapters, responses=ResponseStore(config.max_stored_responses),
                                   tool_parser=make_tool_parser(config.tool_call_parser))
    return app


def embedding_routes() -> list[Route]:
    """The routes of an engine started with --runner pooling (serve/embeddings.py, serve/scoring_routes.py)."""
    handlers = {"/v1/embeddings": embeddings, "/pooling": pooling, "/score": score, "/v1/score": score,
                "/rerank": rerank, "/v1/rerank": rerank, "/v2/rerank": rerank}
    return [Route(path, counted(handler), methods=["POST"]) for path, handler in handlers.items()]


async def _api_error(request: Request, exc: APIError):
    level = logging.INFO if exc.status < 500 else logging.WARNING
    log.log(level, "%s %s %d %s: %s", request.method, request.url.path, exc.status, exc.code or exc.type,
            exc.message)
    return exc.response()


async def _http_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return await _api_error(request, APIError(exc.status_code, message, code=code, headers=exc.headers))


async def _server_error(request: Request, exc: Exception):
    log.exception("%s %s 500", request.method, request.url.path)
    return APIError(500, f"internal server error ({type(exc).__name__})").response()


# -- `jaxpaged serve` -------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags of `jaxpaged serve` to `parser`: the server's (ServerConfig) and the engine's
    (jaxpaged/args.py)."""
    add_server_args(parser)
    add_engine_args(parser)
    return parser


class _Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM/SIGINT end `run()` normally (exit 0) instead of being re-raised; and
    `shutdown_timeout` seconds into the shutdown, `stopping` is set: the streams still open end with an error
    event and [DONE] (uvicorn's own timeout, SHUTDOWN_FLUSH later, is the backstop)."""

    def __init__(self, config: uvicorn.Config, stopping: asyncio.Event, shutdown_timeout: float):
        super().__init__(config)
        self.stopping, self.shutdown_timeout = stopping, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _expire(self) -> None:
        log.info("--shutdown-timeout (%gs) expired: ending the requests still open", self.shutdown_timeout)
        self.stopping.set()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in original.items():
                signal.signal(s, handler)


def run_server(args: argparse.Namespace, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               engine_kwargs: dict | None = None) -> None:
    """Load the model, compile, serve until SIGTERM/SIGINT; in-flight requests get --shutdown-timeout
    seconds to finish, then end (streams with an error event). Returns normally (exit status 0). `args`: the
    flags of `add_serve_args` (the server's ServerConfig, the engine's EngineConfig)."""
    from jaxpaged.parallel.replicas import build_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = ServerConfig.from_args(args, max_body_bytes=max_body_bytes, model_root=args.model or DEFAULT_MODEL_NAME,
                                    served_model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME)
    lora_modules = serve_lora.parse_modules(server.lora_modules, server.served_model_name)
    if (lora_modules or server.enable_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --enable-runtime-lora-updating need --enable-lora")
    cfg = engine_config(args, **(engine_kwargs or {}))  # multi-host: jax.distributed starts first
    log.info("loading %s", args.model or f"the default model ({DEFAULT_MODEL_NAME})")
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    if engine is None:  # a multi-host follower: it ran process 0's steps until process 0 stopped
        log.info("process %d: the leader stopped; exiting", cfg.process_id)
        return
    s = engine.stats()
    log.info("engine ready in %.1fs: %d step shapes compiled in %.1fs, %d KV blocks of %d tokens, "
             "max_model_len %d, attention %s, %d replica(s) x %d device(s), %d process(es)",
             time.perf_counter() - t0, s["num_compilations"], s["compile_seconds"], s["kv_blocks_total"],
             cfg.block_size, engine.max_model_len, s["attention_backend"], cfg.data_parallel_size,
             cfg.tensor_parallel_size, cfg.num_processes)
    adapters = serve_lora.Adapters() if cfg.enable_lora else None
    for lora_name, path in lora_modules:  # checked and loaded now: a bad adapter stops the start
        adapters.by_name[lora_name] = lr = adapters.new(lora_name, path)
        engine.controls.add_lora(lr)
    async_engine = AsyncEngine(engine, max_waiting=server.max_waiting, max_step_failures=server.max_step_failures)
    app = create_app(async_engine, server, adapters=adapters)
    http = protocol(server.request_header_timeout, server.max_connections_per_client or None)
    config = uvicorn.Config(app, host=server.host, port=server.port, access_log=False, lifespan="on", http=http,
                            timeout_graceful_shutdown=server.shutdown_timeout + SHUTDOWN_FLUSH, log_level="info")
    log.info("serving %r on http://%s:%d", server.served_model_name, server.host, server.port)
    _Server(config, app.state.server.stopping, server.shutdown_timeout).run()
    async_engine.shutdown()
    log.info("stopped")
