"""Jobs that `gpu_compile.run` executes in a CPU-only subprocess with the CUDA plugin: compile kernels or
whole engine steps for H100 / H200 (sm_90a) and report what the compiler made. Each job returns JSON.

    python scripts/compile_jobs.py JOB JSON_ARGS OUT_JSON   (what gpu_compile.run starts)
"""
from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from gpu_compile import cuda_mesh, mosaic_stats, new_files, triton_stats

_KERNEL_NAMES = {("triton", "decode"): "paged_attention_decode", ("triton", "ragged"): "ragged_paged_attention",
                 ("mosaic", "decode"): "mosaic_paged_attention_decode",
                 ("mosaic", "ragged"): "mosaic_ragged_paged_attention"}


def kernel_fn(backend: str, kernel: str):
    """The public kernel function of (backend, kernel)."""
    if backend == "triton":
        from pallas_kernels import paged_attention, ragged_paged_attention
        return paged_attention if kernel == "decode" else ragged_paged_attention
    from pallas_kernels.mosaic_gpu_decode import mosaic_paged_attention
    from pallas_kernels.mosaic_gpu_ragged import mosaic_ragged_paged_attention
    return mosaic_paged_attention if kernel == "decode" else mosaic_ragged_paged_attention


def _kernel_args(case: dict, sharding) -> tuple:
    """Abstract (q, k_pool, v_pool, block_tables, seq_lens[, query_start_loc][, k_scale, v_scale])."""
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    S, B, N = case["slots"], case["max_blocks"], case["num_blocks"]
    T = S if case["kernel"] == "decode" else case["tokens"]
    pool_dtype = "bfloat16" if case["kv"] == "bfloat16" else case["kv"]
    pool = sd((N, case["block_size"], case["hkv"], case["head_dim"]), pool_dtype)
    args = [sd((T, case["hq"], case["head_dim"]), "bfloat16"), pool, pool, sd((S, B), "int32"), sd((S,), "int32")]
    if case["kernel"] == "ragged":
        args.append(sd((S + 1,), "int32"))
    if case["kv"] != "bfloat16":
        args += [sd((N, case["block_size"], case["hkv"]), "float32")] * 2
    return tuple(args)


def kernels(cases: list[dict], dumps: dict) -> list[dict]:
    """Compile each kernel case for one H100 and read its registers, spills and shared memory.

    A case: backend (triton | mosaic), kernel (decode | ragged), kv (bfloat16 | int8 | float8_e4m3fn), hq,
    hkv, head_dim, block_size, slots, max_blocks, num_blocks, tokens (ragged), optional tuning (the kernel's
    knobs), plus any labels."""
    sharding = NamedSharding(cuda_mesh(1), P())
    mosaic_seen = {}
    out = []
    for case in cases:
        fn = kernel_fn(case["backend"], case["kernel"])
        quantized = case["kv"] != "bfloat16"
        n = 6 if case["kernel"] == "ragged" else 5

        def call(*a, fn=fn, n=n, quantized=quantized, tuning=case.get("tuning", {})):
            scales = dict(k_scale=a[n], v_scale=a[n + 1]) if quantized else {}
            return fn(*a[:n], **scales, **tuning)
        since, t0 = time.time(), time.perf_counter()
        lowered = jax.jit(call).lower(*_kernel_args(case, sharding))
        lowered.compile()
        seconds = time.perf_counter() - t0
        name = _KERNEL_NAMES[case["backend"], case["kernel"]]
        if case["backend"] == "triton":
            stats = triton_stats(new_files(dumps["xla"], since), name)
        else:  # the plugin compiles a Mosaic GPU module once per process: a repeat (the same kernel under
            # another wrapper, e.g. GQA 4 and 8 both padded to 64 rows) dumps nothing and has the same stats
            key = re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', lowered.as_text()).group(1)
            if key not in mosaic_seen:
                mosaic_seen[key] = mosaic_stats(new_files(dumps["mosaic"], since), name)
            stats = mosaic_seen[key]
        out.append(dict(case, **stats, compile_s=round(seconds, 2), target="sm_90a"))
    return out


if __name__ == "__main__":
    job, payload, out = sys.argv[1:4]
    with open(out, "w") as f:
        json.dump(globals()[job](**json.loads(payload)), f)
