"""One layer's decode attention on the CPU: the C++ kernel (pallas_kernels/attention/cpu.py) against the plain-JAX
reference, jitted on the same arrays, interleaved repetitions, medians.

    jaxpaged bench cpu_attention --dtype bfloat16 float32 --json docs/results/cpu_attention.json
    JAXPAGED_CPU_KERNEL_MARCH=haswell jaxpaged bench cpu_attention     # the kernel's AVX2 build

Shapes default to SmolLM2-135M's heads (9 query, 3 KV, head_dim 64), `--slots` decoding slots with
contexts drawn from `--context MIN MAX`, block 16, a randomly permuted block table (blocks scattered in
the pool as a long-running server leaves them).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from jaxpaged.bench import common as bc


def measure(dtype: str, slots: int, context: tuple[int, int], heads: int, kv_heads: int, head_dim: int,
            block_size: int, repeats: int, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import cpu as cpu_ffi
    from pallas_kernels.attention.reference import ragged_paged_attention_reference
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    lens = rng.integers(context[0], context[1] + 1, slots)
    width = -(-int(lens.max()) // block_size)
    num_blocks = slots * width + 1
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dt) for _ in range(2))
    tables = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(slots, width), jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, heads, head_dim)), dt)
    args = (q, k, v, tables, jnp.asarray(lens, jnp.int32), jnp.arange(slots + 1, dtype=jnp.int32))
    fns = {"reference": jax.jit(ragged_paged_attention_reference),
           "kernel": jax.jit(cpu_ffi.cpu_ragged_paged_attention)}
    outs = {name: np.asarray(f(*args), np.float32) for name, f in fns.items()}  # compiled, warm
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    return dict(dtype=dtype, slots=slots, context_mean=float(lens.mean()), reference_ms=ms["reference"],
                kernel_ms=ms["kernel"], speedup=ms["reference"] / ms["kernel"], vector_lanes=cpu_ffi.vector_lanes(),
                max_abs_diff=float(np.max(np.abs(outs["reference"] - outs["kernel"]))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--context", type=int, nargs=2, default=[150, 450], metavar=("MIN", "MAX"))
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("Q", "KV", "HEAD_DIM"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from pallas_kernels.attention import cpu as cpu_ffi
    if not cpu_ffi.available():
        raise SystemExit("the CPU kernel cannot be built here (see the warning above)")
    rows = [measure(d, args.slots, tuple(args.context), *args.heads, args.block_size, args.repeats)
            for d in args.dtype]
    print(bc.table([[r["dtype"], f"{r['reference_ms']:.2f}", f"{r['kernel_ms']:.2f}", f"{r['speedup']:.2f}x",
                     r["vector_lanes"]] for r in rows],
                   ["pool", "reference ms", "kernel ms", "speedup", "vector lanes"]))
    bc.write_json(args.json, {"machine": bc.machine_info(), "rows": rows, "settings": vars(args)})
    return 0
