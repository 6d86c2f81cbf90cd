"""Engine flags, generated once from EngineConfig's fields: `jaxpaged generate | serve` (jaxpaged/cli.py,
serve/app.py) and the bench scripts (jaxpaged/bench/common.py) take the same ones.

    add_engine_args(parser, defaults={"max_num_seqs": 8})  # per entry point: defaults, helps, exclude
    cfg = engine_config(parser.parse_args())                # or engine_kwargs(args) for LLM(**kw)

A field `max_num_seqs: int = option(64, SCHEDULER, "...")` (jaxpaged/config.py) is the flag
`--max-num-seqs N`: its type and default are the field's, its help and argparse group its metadata's.
A bool is `--x / --no-x`, a list `--x A B ...`, `Any` a string (speculative_config: JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from jaxpaged.config import EngineConfig

ENGINE_FIELDS = "engine_fields"  # the namespace attribute naming the fields a parser took as engine flags


def flag_name(field_name: str) -> str:
    """The engine flag of an EngineConfig field: max_num_seqs -> --max-num-seqs."""
    return "--" + field_name.replace("_", "-")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _type_kwargs(hint: Any) -> dict:
    """argparse keywords for a field's type: bool -> --x / --no-x, list[T] -> nargs, Any -> a string."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    base = next((a for a in args if a is not type(None)), hint)  # X | None -> X
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is list:
        return {"nargs": "+", "type": typing.get_args(base)[0]}
    return {"type": str if base is Any else base}


def _add_flag(container, f: dataclasses.Field, hint: Any, default: Any, help: str) -> None:
    """Add the flag of EngineConfig field `f` to a parser or argument group."""
    meta = {k: v for k, v in f.metadata.items() if k not in ("group", "help")}
    action = container.add_argument(flag_name(f.name), dest=f.name, default=default, help=help.replace("%", "%%"),
                                    **_type_kwargs(hint), **meta)
    if default is not None and "%(default)" not in action.help:  # BooleanOptionalAction may have added it
        action.help += " (default: %(default)s)"


def add_engine_args(parser: argparse.ArgumentParser, *, defaults: dict[str, Any] | None = None,
                    helps: dict[str, str] | None = None, exclude: tuple[str, ...] = ()) -> None:
    """Add one flag per EngineConfig field to `parser`, in argparse groups by concern (the fields' order),
    titled `engine: <concern>`. Per entry point: `defaults` and `helps` replace fields' defaults and help
    texts; `exclude` leaves fields out (to a flag of the entry point's own of that name). `engine_kwargs`
    reads the flags back."""
    defaults, helps = defaults or {}, helps or {}
    unknown = (set(defaults) | set(helps) | set(exclude)) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"not EngineConfig fields: {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(EngineConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]
    for f in fields:
        title = f.metadata["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(f"engine: {title}")
        _add_flag(groups[title], f, hints[f.name], defaults.get(f.name, _default(f)),
                  helps.get(f.name, f.metadata["help"]))
    parser.set_defaults(**{ENGINE_FIELDS: tuple(f.name for f in fields)})


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict[str, Any]:
    """EngineConfig's keyword arguments from the engine flags in `args` (`overrides` win). Multi-host
    (`--num-processes` > 1): starts jax.distributed first, before anything else uses JAX."""
    kw = {name: getattr(args, name) for name in getattr(args, ENGINE_FIELDS)} | overrides
    if kw.get("num_processes", 1) > 1:
        from jaxpaged.parallel.multihost import initialize
        initialize(kw.get("coordinator_address"), kw["num_processes"], kw.get("process_id", 0))
    return kw


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of the engine flags in `args` (`overrides` win); see `engine_kwargs`."""
    return EngineConfig(**engine_kwargs(args, **overrides))


def add_engine_flag(parser: argparse.ArgumentParser, name: str, help: str | None = None) -> argparse.ArgumentParser:
    """One engine flag alone, of EngineConfig field `name` (`jaxpaged convert` takes --quantization and
    --keep-quantized); `help` replaces the field's help text."""
    f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    _add_flag(parser, f, typing.get_type_hints(EngineConfig)[name], _default(f), help or f.metadata["help"])
    return parser
