"""The Starlette app (`create_app`) and `jaxpaged serve` (`add_serve_args`, `run_server`).

    engine = AsyncEngine(LLMEngine(EngineConfig(model=DIR)), max_waiting=512)
    app = create_app(engine, served_model_name="my-model", api_key=None)
    uvicorn.run(app)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from serve import batch_chat, chat, invocations, rl_routes, routes, tokenize_routes
from serve import lora as serve_lora
from serve.errors import APIError
from serve.http_protocol import protocol
from serve.load import Load, counted, server_load
from serve.metrics import Metrics
from serve.openapi import openapi_schema
from serve.reasoning import PARSERS, ReasoningParser, make_parser
from serve.tools import DEFAULT_MAX_GRAMMAR_BYTES

log = logging.getLogger("jaxpaged.serve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 16 * 2 ** 20
DEFAULT_MAX_WAITING = 512
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds in-flight requests get after SIGTERM
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a request's header may take to arrive
DEFAULT_BODY_TIMEOUT = 60.0  # seconds a request's body may take to arrive
SHUTDOWN_FLUSH = 5.0  # seconds after --shutdown-timeout for the final events to reach clients


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: str | None
    max_body_bytes: int
    metrics: Metrics
    openapi: dict
    created: int
    adapters: serve_lora.Adapters | None = None  # LoRA adapters by name (--enable-lora)
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT  # seconds to read a body (None: no deadline)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set when --shutdown-timeout expires
    model_root: str | None = None  # /v1/models' `root` of the base model: its path or name as given
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details (cached_tokens), else null
    max_logprobs: int = 20  # the most logprobs per token a request may ask (-1 asks this many)
    force_include_usage: bool = False  # streams end with a usage chunk even without stream_options
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as 'token_id:N' unless a request says otherwise
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # a request's constraint text (--max-grammar-bytes)
    reasoning: ReasoningParser = field(default_factory=ReasoningParser)  # --reasoning-parser (default: none)
    load: Load = field(default_factory=Load)  # GET /load (counted with --enable-server-load-tracking)


def create_app(engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_engine: bool = True,
               adapters: serve_lora.Adapters | None = None, runtime_lora_updating: bool = False,
               body_timeout: float | None = DEFAULT_BODY_TIMEOUT, model_root: str | None = None,
               prompt_tokens_details: bool = False, tokenizer_info: bool = False, force_include_usage: bool = False,
               return_tokens_as_token_ids: bool = False,
               max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES, reasoning_parser: str | None = None,
               server_load_tracking: bool = False) -> Starlette:
    """The OpenAI-compatible app over `engine`; with `api_key`, /v1/* need `Authorization: Bearer KEY`;
    a request body must arrive within `body_timeout` seconds (408); `model_root`: the base model's path or
    name as given (/v1/models' `root`; default `served_model_name`); `prompt_tokens_details`: usage carries
    prompt_tokens_details.cached_tokens (else it is null, as vLLM's without --enable-prompt-tokens-details);
    `tokenizer_info`: serve GET /tokenizer_info too; `force_include_usage`: every stream ends with a usage
    chunk (--enable-force-include-usage); `return_tokens_as_token_ids`: logprobs' tokens are 'token_id:N'
    unless a request's return_tokens_as_token_ids says otherwise; `max_grammar_bytes`: the most bytes of a
    request's constraint text (schema, regex, grammar, choices; --max-grammar-bytes), else a 400;
    `reasoning_parser`: a chat answer's reasoning split from its content (serve/reasoning.py: deepseek_r1, qwen3).
    `server_load_tracking`: GET /load counts the generation requests in flight (else it answers 0).
    `adapters`: the LoRA adapters already added to the engine, by name (requests pick one by `model`);
    `runtime_lora_updating`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter too."""
    from jaxpaged import __version__

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown)

    app = Starlette(routes=[
        Route("/v1/completions", counted(routes.completions), methods=["POST"]),
        Route("/v1/chat/completions", counted(chat.chat_completions), methods=["POST"]),
        Route("/v1/chat/completions/batch", counted(batch_chat.batch_chat_completions), methods=["POST"]),
        Route("/invocations", counted(invocations.invocations), methods=["POST"]),
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
    ] + ([Route("/tokenizer_info", tokenize_routes.tokenizer_info, methods=["GET"])] if tokenizer_info else [])
      + ([Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
          Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"])]
         if runtime_lora_updating else []),
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan)
    limits = engine.request_limits()
    schema = openapi_schema(__version__, limits=limits, model_name=served_model_name,
                            max_grammar_bytes=max_grammar_bytes,
                            api_key=bool(api_key), tokenizer_info=tokenizer_info)
    app.state.server = ServerState(engine, served_model_name, api_key or None, max_body_bytes,
                                   Metrics(engine, served_model_name, limits["max_model_len"]), schema,
                                   int(time.time()),
                                   adapters if adapters is not None else
                                   serve_lora.Adapters() if runtime_lora_updating else None, body_timeout,
                                   model_root=model_root or served_model_name,
                                   prompt_tokens_details=prompt_tokens_details,
                                   max_logprobs=limits["max_logprobs"], force_include_usage=force_include_usage,
                                   return_tokens_as_token_ids=return_tokens_as_token_ids,
                                   max_grammar_bytes=max_grammar_bytes, reasoning=make_parser(reasoning_parser),
                                   load=Load(server_load_tracking))
    return app


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
    """Add the flags of `jaxpaged serve` to `parser`: the engine flags (jaxpaged/args.py) and the server's."""
    parser.add_argument("--served-model-name", default=None, help="the name clients send as `model` "
                        "(default: --model as given, or the default model's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, help="requests queued for a "
                        "batch slot before new ones get 503 + Retry-After (default %(default)s)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", help="usage carries "
                        "prompt_tokens_details.cached_tokens, the prompt tokens served by the prefix cache "
                        "(default: null)")
    parser.add_argument("--reasoning-parser", choices=sorted(PARSERS), default=None, help="chat answers' "
                        "reasoning (the text in <think>...</think>) in message.reasoning_content and "
                        "message.reasoning, the rest in content, streamed as deltas of each; deepseek_r1: "
                        "the output may start inside the reasoning, qwen3: both tags expected (default: "
                        "no split)")
    parser.add_argument("--tool-call-parser", choices=["hermes"], default=None, help="how tool calls are read "
                        "from text for tool_choice auto: hermes, the <tool_call>...</tool_call> blocks of SmolLM2's, "
                        "Qwen2.5's and Hermes' templates, is the one syntax here (and the default); "
                        "tool_choice required or named is constrained by grammar")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted for vLLM's command "
                        "lines: tool_choice auto is always served here")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="serve GET "
                        "/tokenizer_info (the tokenizer's special tokens and chat template)")
    parser.add_argument("--enable-force-include-usage", action="store_true", help="every stream ends with a "
                        "usage chunk, even without stream_options.include_usage")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true", help="logprobs' tokens written as "
                        "'token_id:N' (a request's return_tokens_as_token_ids overrides it)")
    parser.add_argument("--enable-server-load-tracking", action="store_true", help="GET /load answers the "
                        "generation requests in flight, {\"server_load\": N} (without it: 0)")
    parser.add_argument("--max-step-failures", type=int, default=3, help="failed steps in a row after which "
                        "the engine stops and /health answers 503; a failed step fails only its own "
                        "requests (500) (default %(default)s)")
    limits = parser.add_argument_group("server: deadlines and bounds on work")
    limits.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, help="seconds "
                        "in-flight requests get to finish after SIGTERM/SIGINT; streams still open then end "
                        "with an error event (code server_shutdown) and [DONE] (default %(default)s)")
    limits.add_argument("--request-header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds a request's header may take to arrive, else the connection is closed; "
                        "0: no deadline (default %(default)s)")
    limits.add_argument("--request-body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT,
                        help="seconds a request's body may take to arrive, else 408; 0: no deadline "
                        "(default %(default)s)")
    limits.add_argument("--max-connections-per-client", type=int, default=0, help="connections one client "
                        "(IP address) may hold open at once, further ones closed at once; 0: no bound "
                        "(default %(default)s)")
    limits.add_argument("--max-grammar-bytes", type=_positive, default=DEFAULT_MAX_GRAMMAR_BYTES, help="bytes of "
                        "a request's output constraint (response_format's JSON schema serialized, "
                        "structured_outputs' schema, regex, grammar or choices, the tools' parameters for "
                        "tool_choice required or named), else a 400 grammar_too_large before any compiling "
                        "(default %(default)s)")
    lora = parser.add_argument_group("server: LoRA adapters (with --enable-lora)")
    lora.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=None,
                      help="PEFT adapter directories to serve, by name (requests pick one by `model`)")
    lora.add_argument("--enable-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    add_engine_args(parser)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _seconds(text: str) -> float | None:
    """A deadline flag's value: seconds > 0, or 0 for none (None)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: no deadline), got {text}")
    return value or None


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
    seconds to finish, then end (streams with an error event). Returns normally (exit status 0)."""
    from jaxpaged.parallel.replicas import build_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lora_modules = serve_lora.parse_modules(args.lora_modules)
    if (lora_modules or args.enable_runtime_lora_updating) and not args.enable_lora:
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
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting, max_step_failures=args.max_step_failures)
    name = args.served_model_name or (args.model if args.model else DEFAULT_MODEL_NAME)
    app = create_app(async_engine, served_model_name=name, api_key=args.api_key, max_body_bytes=max_body_bytes,
                     adapters=adapters, runtime_lora_updating=args.enable_runtime_lora_updating,
                     body_timeout=args.request_body_timeout, model_root=args.model or DEFAULT_MODEL_NAME,
                     prompt_tokens_details=args.enable_prompt_tokens_details,
                     tokenizer_info=args.enable_tokenizer_info_endpoint,
                     force_include_usage=args.enable_force_include_usage,
                     return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                     max_grammar_bytes=args.max_grammar_bytes, reasoning_parser=args.reasoning_parser,
                     server_load_tracking=args.enable_server_load_tracking)
    http = protocol(args.request_header_timeout, args.max_connections_per_client or None)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=False, lifespan="on", http=http,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_FLUSH, log_level="info")
    log.info("serving %r on http://%s:%d", name, args.host, args.port)
    _Server(config, app.state.server.stopping, args.shutdown_timeout).run()
    async_engine.shutdown()
    log.info("stopped")
