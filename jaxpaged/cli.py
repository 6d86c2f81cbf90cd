"""`jaxpaged generate | serve | convert | fetch-default`: the command-line entry point. The engine flags of
`generate` and `serve` are generated from EngineConfig (jaxpaged/args.py); each subcommand adds its own."""
from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import time

from jaxpaged.args import add_engine_args, add_engine_flag, engine_kwargs

# `generate` runs a few prompts: a smaller batch and budget than the engine's defaults, so it compiles less;
# its --seed is every prompt's sampling seed (none: unseeded)
GENERATE_DEFAULTS = dict(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=256, seed=None)


# Where an accelerator's driver shows itself: NVIDIA's device node or driver, AMD's compute driver (ROCm),
# TPU chips as /dev/accel* (v2-v4) or as PCI devices of Google's vendor id 0x1ae0 (v5e and later, behind vfio)
_ACCELERATOR_PATHS = ("/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/accel*")
_GOOGLE_PCI_VENDOR = "0x1ae0"


def accelerator_present() -> bool:
    """Whether this machine shows a GPU or TPU to its processes (device nodes, drivers, PCI vendor ids)."""
    if any(glob.glob(p) for p in _ACCELERATOR_PATHS):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def select_platform(environ=os.environ) -> None:
    """With JAX_PLATFORMS unset and no accelerator on the machine, set it to `cpu` before jax is imported:
    the GPU and TPU plugins an environment may hold (the `test` extra installs both) then are never
    initialised, so they print no traceback nor error line on start. A set JAX_PLATFORMS is left alone,
    and with an accelerator present jax picks it as usual."""
    if "JAX_PLATFORMS" in environ or accelerator_present():
        return
    environ["JAX_PLATFORMS"] = "cpu"
    logging.getLogger(__name__).debug("no GPU or TPU on this machine: JAX_PLATFORMS=cpu (set it to choose)")


def _generate(args) -> int:
    from jaxpaged import LLM, SamplingParams
    llm = LLM(**engine_kwargs(args, seed=0 if args.seed is None else args.seed))
    if not llm.is_leader:  # a multi-host follower: it ran process 0's steps until process 0 stopped
        return 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            top_p=args.top_p)
    prompts = args.prompt
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for p, o in zip(prompts, outs):
        print(f"[prompt] {p}", file=sys.stderr)
        print(o.outputs[0].text)
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def _convert(args) -> int:
    from jaxpaged.checkpoints.convert import convert
    print(convert(args.src, args.dst, dtype=args.dtype, force=args.force, quantization=args.quantization,
                  keep_quantized=args.keep_quantized))
    return 0


def _fetch_default(args) -> int:
    from jaxpaged.checkpoints.default_model import fetch_default
    fetch_default(verbose=True)
    return 0


def _serve(args) -> int:
    from serve.app import run_server
    return run_server(args) or 0


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(g, defaults=GENERATE_DEFAULTS, helps={"seed": "every prompt's sampling seed (default: unseeded)"})
    g.set_defaults(func=_generate)


def _add_convert(sub) -> None:
    c = sub.add_parser("convert", help="convert a HF directory or .gguf file to the engine's format")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--force", action="store_true", help="replace a non-empty DST")
    add_engine_flag(c, "quantization")
    add_engine_flag(c, "keep_quantized", "a .gguf SRC: its quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
                    "Q5_K, Q6_K) stay quantized, exactly, and load packed; --no-keep-quantized dequantizes them "
                    "into --dtype")
    c.set_defaults(func=_convert)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    try:
        from serve.app import add_serve_args
        add_serve_args(s)
    except ImportError:
        pass
    s.set_defaults(func=_serve)


def _add_bench(sub) -> None:
    from jaxpaged import bench
    b = sub.add_parser("bench", help="run a benchmark (`jaxpaged bench WHAT --help`)",
                       description="\n".join(f"{k:<20}{v}" for k, v in bench.COMMANDS.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("what", choices=list(bench.COMMANDS), metavar="WHAT", help="one of the commands listed above")
    b.add_argument("flags", nargs=argparse.REMAINDER, help="the command's own flags")
    b.set_defaults(func=lambda a: bench.run(a.what, a.flags))


def build_parser() -> argparse.ArgumentParser:
    """`jaxpaged`'s parser: one subparser per command (`_add_<command>` adds its flags)."""
    ap = argparse.ArgumentParser(prog="jaxpaged", description="A small LLM inference engine on JAX")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    f = sub.add_parser("fetch-default", help="install and convert the embedded default model")
    f.set_defaults(func=_fetch_default)
    _add_serve(sub)
    _add_bench(sub)
    return ap


def main(argv=None) -> int:
    select_platform()  # before anything imports jax
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"jaxpaged: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
