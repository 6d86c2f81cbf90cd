#!/usr/bin/env python
"""Convert a Hugging Face model directory or a .gguf file to jaxpaged's format (same as `jaxpaged convert`).

    python scripts/convert_hf.py SRC DST [--dtype bfloat16] [--quantization int8|fp8] [--force] [--no-progress]
"""
import argparse
import sys

from jaxpaged.args import add_quantization_arg
from jaxpaged.checkpoints.convert import convert


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="Hugging Face model directory (single or sharded safetensors) or .gguf file")
    p.add_argument("dst", help="output directory (must be absent or empty unless --force)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="parameter dtype stored in DST (default: bfloat16)")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_quantization_arg(p)
    a = p.parse_args(argv)
    try:
        out = convert(a.src, a.dst, dtype=a.dtype, force=a.force, progress=not a.no_progress,
                      quantization=a.quantization)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
