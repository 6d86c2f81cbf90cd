"""ServerConfig: how `jaxpaged serve` serves, declared once. Each field with a help text is one flag of
`jaxpaged serve` (vLLM's names: --api-key, --max-waiting, ...), its type, default and choices the field's;
`create_app(engine, config)` (serve/app.py) and `run_server` read the same object.

    parser = add_server_args(argparse.ArgumentParser())   # the server's flags (serve/app.py adds the engine's)
    config = ServerConfig.from_args(parser.parse_args())  # or ServerConfig(served_model_name="m", api_key="k")

A field `port: int = flag(8000, "the port")` is the flag `--port N`; a bool field is a switch (`--x`, default
off); `group` puts the flag under an argparse group's title; further metadata (choices, type, nargs, metavar)
goes to argparse as it is. A field made with `setting` is not a flag: the embedding code sets it.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from jaxpaged.args import flag_name
from serve.reasoning import PARSERS
from serve.tool_parsers import PARSERS as TOOL_PARSERS
from serve.tools import DEFAULT_MAX_GRAMMAR_BYTES

DEFAULT_MAX_BODY_BYTES = 16 * 2 ** 20
DEFAULT_MAX_WAITING = 512
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds in-flight requests get after SIGTERM
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a request's header may take to arrive
DEFAULT_BODY_TIMEOUT = 60.0  # seconds a request's body may take to arrive
DEFAULT_MAX_EMBEDDING_INPUTS = 256  # inputs of one embeddings request (--max-embedding-inputs)

LIMITS, LORA = "server: deadlines and bounds on work", "server: LoRA adapters (with --enable-lora)"


def flag(default: Any, help: str | None, *, group: str | None = None, **argparse_kw) -> Any:
    """A ServerConfig field that is a flag of `jaxpaged serve`: its default and, as metadata, its help (None:
    none), argparse group and further argparse keywords (choices, type, nargs, metavar)."""
    return field(default=default, metadata={"flag": True, "help": help, "group": group, **argparse_kw})


def setting(default: Any) -> Any:
    """A ServerConfig field without a flag (set by the code that embeds the app or starts the server)."""
    return field(default=default, metadata={"flag": False})


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


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings: the flags of `jaxpaged serve` beside the engine's, and the app's settings."""
    served_model_name: str | None = flag(None, "the name clients send as `model` (default: --model as given, or "
                                         "the default model's name)")
    host: str = flag("127.0.0.1", None)
    port: int = flag(8000, None)
    api_key: str | None = flag(None, "require `Authorization: Bearer KEY` on /v1/*")
    max_waiting: int = flag(DEFAULT_MAX_WAITING, "requests queued for a batch slot before new ones get 503 + "
                            "Retry-After (default %(default)s)")
    enable_prompt_tokens_details: bool = flag(False, "usage carries prompt_tokens_details.cached_tokens, the "
                                              "prompt tokens served by the prefix cache (default: null)")
    reasoning_parser: str | None = flag(None, "chat answers' reasoning (the text in <think>...</think>) in "
                                        "message.reasoning_content and message.reasoning, the rest in content, "
                                        "streamed as deltas of each; deepseek_r1: the output may start inside the "
                                        "reasoning, qwen3: both tags expected (default: no split)",
                                        choices=sorted(PARSERS))
    tool_call_parser: str | None = flag(None, "how tool calls are read from text for tool_choice auto (vLLM's "
                                        "names): hermes (the default: <tool_call>{json}</tool_call> blocks), "
                                        "llama3_json, mistral, pythonic, qwen3_coder; tool_choice required or named "
                                        "is constrained by grammar", choices=sorted(TOOL_PARSERS))
    enable_auto_tool_choice: bool = flag(False, "accepted for vLLM's command lines: tool_choice auto is always "
                                         "served here")
    enable_tokenizer_info_endpoint: bool = flag(False, "serve GET /tokenizer_info (the tokenizer's special tokens "
                                                "and chat template)")
    enable_force_include_usage: bool = flag(False, "every stream carries usage, as vLLM's: the usage so far on "
                                            "each chunk and a last usage chunk, even without stream_options")
    return_tokens_as_token_ids: bool = flag(False, "logprobs' tokens written as 'token_id:N' (a request's "
                                            "return_tokens_as_token_ids overrides it)")
    enable_server_load_tracking: bool = flag(False, "GET /load answers the generation requests in flight, "
                                             "{\"server_load\": N} (without it: 0)")
    max_step_failures: int = flag(3, "failed steps in a row after which the engine stops and /health answers 503; "
                                  "a failed step fails only its own requests (500) (default %(default)s)")
    shutdown_timeout: float = flag(DEFAULT_SHUTDOWN_TIMEOUT, "seconds in-flight requests get to finish after "
                                   "SIGTERM/SIGINT; streams still open then end with an error event (code "
                                   "server_shutdown) and [DONE] (default %(default)s)", group=LIMITS)
    request_header_timeout: float | None = flag(DEFAULT_HEADER_TIMEOUT, "seconds a request's header may take to "
                                                "arrive, else the connection is closed; 0: no deadline (default "
                                                "%(default)s)", group=LIMITS, type=_seconds)
    request_body_timeout: float | None = flag(DEFAULT_BODY_TIMEOUT, "seconds a request's body may take to arrive, "
                                              "else 408; 0: no deadline (default %(default)s)", group=LIMITS,
                                              type=_seconds)
    max_connections_per_client: int = flag(0, "connections one client (IP address) may hold open at once, further "
                                           "ones closed at once; 0: no bound (default %(default)s)", group=LIMITS)
    max_grammar_bytes: int = flag(DEFAULT_MAX_GRAMMAR_BYTES, "bytes of a request's output constraint "
                                  "(response_format's JSON schema serialized, structured_outputs' schema, regex, "
                                  "grammar or choices, the tools' parameters for tool_choice required or named), "
                                  "else a 400 grammar_too_large before any compiling (default %(default)s)",
                                  group=LIMITS, type=_positive)
    max_stored_responses: int = flag(1024, "finished /v1/responses responses kept in memory for GET and "
                                     "previous_response_id, the least recently used dropped first; 0: none kept "
                                     "(default %(default)s)", group=LIMITS)
    max_embedding_inputs: int = flag(DEFAULT_MAX_EMBEDDING_INPUTS, "inputs one embeddings, pooling, score or rerank "
                                     "request may carry (texts or token-id lists together), else a 400 naming the "
                                     "field (default %(default)s)", group=LIMITS, type=_positive)
    lora_modules: list[str] | None = flag(None, "PEFT adapter directories to serve, by name (requests pick one by "
                                          "`model`): NAME=PATH or vLLM's JSON {\"name\": N, \"path\": P, "
                                          "\"base_model_name\": B}", group=LORA, nargs="+", metavar="NAME=PATH")
    enable_runtime_lora_updating: bool = flag(False, "serve POST /v1/load_lora_adapter and "
                                              "/v1/unload_lora_adapter", group=LORA)
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES)  # a request body's size limit (413 above it)
    model_root: str | None = setting(None)  # /v1/models' `root`: the base model's path or name (default: the name)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> ServerConfig:
        """The ServerConfig of the server flags in `args` (`overrides` win, non-flag fields included)."""
        return cls(**{f.name: getattr(args, f.name) for f in flag_fields()} | overrides)


def flag_fields() -> list[dataclasses.Field]:
    """ServerConfig's fields that are flags, in the order `jaxpaged serve --help` lists them."""
    return [f for f in dataclasses.fields(ServerConfig) if f.metadata["flag"]]


def _type_kwargs(hint: Any) -> dict:
    """argparse keywords for a field's type: bool -> a switch, list[T] -> items of type T, X | None -> X."""
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if base is bool:
        return {"action": "store_true"}
    return {"type": typing.get_args(base)[0] if typing.get_origin(base) is list else base}


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per ServerConfig flag field to `parser` (grouped fields under their group's title)."""
    hints = typing.get_type_hints(ServerConfig)
    groups: dict[str | None, Any] = {None: parser}
    for f in flag_fields():
        title = f.metadata["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        kw = _type_kwargs(hints[f.name]) | {k: v for k, v in f.metadata.items() if k not in ("flag", "group")}
        groups[title].add_argument(flag_name(f.name), dest=f.name, default=f.default, **kw)
    return parser
