"""One source of engine flags: `jaxpaged generate`, `jaxpaged serve` and the bench scripts take the same
ones, generated from EngineConfig's fields (jaxpaged/args.py); each field has a flag, a help and a group."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from jaxpaged.args import add_engine_args, engine_config, engine_kwargs, flag_name
from jaxpaged.bench import common
from jaxpaged.cli import GENERATE_DEFAULTS, build_parser
from jaxpaged.config import (
    CACHE,
    COMPILATION,
    KV_CACHE_DTYPES,
    LORA,
    MODEL,
    PARALLEL,
    QUANTIZATIONS,
    RESEARCH,
    SCHEDULER,
    SPECULATIVE,
    EngineConfig,
)

FIELDS = dataclasses.fields(EngineConfig)
BOOLS = {f.name for f in FIELDS if "bool" in str(f.type)}
ENGINE_FLAGS = {flag_name(f.name) for f in FIELDS} | {"--no-" + flag_name(n)[2:] for n in BOOLS}


def _command(name: str) -> argparse.ArgumentParser:
    """The subparser of `jaxpaged NAME`."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _bench() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    common.add_engine_args(ap)
    return ap


def _engine_flags_in_help(parser: argparse.ArgumentParser) -> set[str]:
    """The flags listed under the `engine: ...` sections of the parser's --help."""
    flags, in_engine = set(), False
    for line in parser.format_help().splitlines():
        if line and not line[0].isspace():  # a section's title
            in_engine = line.startswith("engine: ")
        elif in_engine and line.startswith("  -"):  # a flag's line: the flags, then maybe the help
            flags |= set(re.findall(r"--[a-z][a-z-]*", line.strip().split("  ")[0]))
    return flags


def test_generate_serve_and_bench_list_the_same_engine_flags():
    helps = {name: _engine_flags_in_help(p) for name, p in
             (("generate", _command("generate")), ("serve", _command("serve")), ("bench", _bench()))}
    assert helps["generate"] == helps["serve"] == helps["bench"] == ENGINE_FLAGS
    parsed = {name: p.parse_args(["--prompt", "x"] if name == "generate" else []) for name, p in
              (("generate", _command("generate")), ("serve", _command("serve")), ("bench", _bench()))}
    assert {name: set(engine_kwargs(a)) for name, a in parsed.items()} == {
        name: {f.name for f in FIELDS} for name in parsed}


def test_every_field_has_a_flag_a_help_and_a_group():
    groups = (MODEL, SCHEDULER, CACHE, PARALLEL, SPECULATIVE, LORA, RESEARCH, COMPILATION)
    for f in FIELDS:
        assert f.metadata.get("help"), f"{f.name} has no help"
        assert f.metadata.get("group") in groups, f"{f.name}: group {f.metadata.get('group')!r}"
    # the fields come grouped: each group's fields are consecutive, in the groups' order
    order = [f.metadata["group"] for f in FIELDS]
    assert sorted(dict.fromkeys(order), key=groups.index) == list(dict.fromkeys(order))
    assert all(order[i] == order[i - 1] or order[i] not in order[:i] for i in range(1, len(order)))
    help_text = _command("serve").format_help()
    for f in FIELDS:
        assert flag_name(f.name) in help_text


def test_defaults_are_the_fields_but_where_an_entry_point_says():
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default for f in FIELDS}
    assert engine_kwargs(_command("serve").parse_args([])) == defaults
    assert engine_kwargs(_command("generate").parse_args(["--prompt", "x"])) == defaults | GENERATE_DEFAULTS
    bench = engine_kwargs(_bench().parse_args([]))
    assert {k: v for k, v in bench.items() if v != defaults[k]} == dict(dtype="float32", show_progress=False)


def test_flag_types_reach_the_config():
    args = _command("serve").parse_args([
        "--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory-gb", "0.5", "--no-enable-prefix-caching",
        "--hidden-state-layers", "0", "2", "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 2}), "--quantization", "int8",
        "--no-warmup"])
    cfg = engine_config(args, show_progress=False)
    assert (cfg.dtype, cfg.max_num_seqs, cfg.kv_cache_memory_gb) == ("float32", 4, 0.5)
    assert (cfg.enable_prefix_caching, cfg.hidden_state_layers, cfg.quantization) == (False, [0, 2], "int8")
    assert (cfg.warmup, cfg.show_progress) == (False, False)
    assert cfg.speculative_config.num_speculative_tokens == 2
    for bad in (["--dtype", "float64"], ["--max-num-seqs", "x"], ["--logprobs-mode", "raw"]):
        with pytest.raises(SystemExit):
            _command("serve").parse_args(bad)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):  # EngineConfig's check
        engine_config(_command("serve").parse_args(["--max-num-seqs", "0"]))


def test_exclude_leaves_a_flag_to_the_entry_point():
    ap = argparse.ArgumentParser()
    ap.add_argument("--async-scheduling", choices=["on", "off", "auto"], default="auto")
    add_engine_args(ap, exclude=("async_scheduling",))
    args = ap.parse_args(["--async-scheduling", "on"])
    assert args.async_scheduling == "on" and "async_scheduling" not in engine_kwargs(args)
    with pytest.raises(ValueError, match="not EngineConfig fields: max_seqs"):
        add_engine_args(argparse.ArgumentParser(), defaults={"max_seqs": 8})


def test_choices_are_the_validating_modules():
    """The flags offer what the modules that use the values accept (jaxpaged/config.py's choices)."""
    from jaxpaged.models import qarray
    from jaxpaged.step import kv_cache
    assert (KV_CACHE_DTYPES, QUANTIZATIONS) == (kv_cache.KV_CACHE_DTYPES, qarray.QUANTIZATIONS)
