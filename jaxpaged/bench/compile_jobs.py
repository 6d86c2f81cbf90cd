"""Jobs that `gpu_compile.run` executes in a CPU-only subprocess with the CUDA plugin: compile kernels or
whole engine steps for H100 / H200 (sm_90a) and report what the compiler made. Each job returns JSON.

    python -m jaxpaged.bench.compile_jobs JOB JSON_ARGS OUT_JSON   (what gpu_compile.run starts)
"""
from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.bench.gpu_compile import cuda_mesh, mosaic_stats, new_files, triton_stats

_KERNEL_NAMES = {("triton", "decode"): "paged_attention_decode", ("triton", "ragged"): "ragged_paged_attention",
                 ("mosaic", "decode"): "mosaic_paged_attention_decode",
                 ("mosaic", "ragged"): "mosaic_ragged_paged_attention"}


def kernel_fn(backend: str, kernel: str):
    """The public kernel function of (backend, kernel)."""
    if backend == "triton":
        from pallas_kernels import paged_attention, ragged_paged_attention
        return paged_attention if kernel == "decode" else ragged_paged_attention
    from pallas_kernels.attention.mosaic_gpu_decode import mosaic_paged_attention
    from pallas_kernels.attention.mosaic_gpu_ragged import mosaic_ragged_paged_attention
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


# Llama-3 shapes (HF config.json fields), random weights never made: the compile needs shapes only
LLAMA3 = {"8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8),
          "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8)}


def model_config(size: str, num_layers: int | None = None):
    """A Llama-3-`size`-shaped ModelConfig (num_layers overrides the depth, for quick checks)."""
    from jaxpaged.config import ModelConfig
    d = dict(LLAMA3[size], architectures=["LlamaForCausalLM"], vocab_size=128256, max_position_embeddings=8192,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    if num_layers:
        d["num_hidden_layers"] = num_layers
    return ModelConfig.from_hf_dict(d)


MAX_UNROLLED = 40  # deeper models: costs extrapolated from unrolled 2- and 4-layer compiles


def _costs(c: dict, cfg, mesh, variant, layers: int) -> dict:
    """HLO costs of `variant` with the layer scan fully unrolled (XLA counts a while body once). Past
    MAX_UNROLLED layers (a very long compile), flops from 2- and 4-layer compiles, extrapolated linearly
    (exact for a stack of identical layers); bytes are then not reported."""
    from jaxpaged.bench.gpu_compile import FULL_UNROLL, step_costs
    from jaxpaged.step.aot import abstract_runner, compile_steps

    def unrolled(num_layers):
        runner = abstract_runner(model_config(c["size"], num_layers), cfg, mesh, num_blocks=c["num_blocks"])
        runner.compiler_options = dict(runner.compiler_options or {}, **FULL_UNROLL)
        return step_costs(compile_steps(runner, [variant])[variant])
    if layers <= MAX_UNROLLED:
        return dict(unrolled(layers), cost_method="fully unrolled")
    two, four = unrolled(2), unrolled(4)
    return dict(flops=two["flops"] + (layers - 2) / 2 * (four["flops"] - two["flops"]), bytes_accessed=None,
                kernel_operand_bytes=None, cost_method="2 and 4 layers unrolled, extrapolated")


def steps(configs: list[dict], dumps: dict) -> list[dict]:
    """Compile the engine's whole step for H100 meshes (jaxpaged/step/aot.py) and report, per variant:
    memory_analysis(), and for the `cost_variants` the HLO costs of an unrolled compile (`_costs`).

    A config: size (8B | 70B), num_layers (optional), tp, kv_cache_dtype, quantization (optional: int8 /
    int4 weights, XLA's dequantize-then-dot on the GPU), max_num_seqs,
    max_num_batched_tokens, max_model_len, num_blocks (per layer), variants (list of [T, decode_only], or
    None for all), cost_variants (list of [T, decode_only]), plus labels."""
    del dumps
    from jaxpaged.bench.gpu_compile import KERNEL_TARGETS, memory
    from jaxpaged.config import EngineConfig
    from jaxpaged.models.qarray import QArray
    from jaxpaged.step.aot import abstract_runner, compile_steps
    out = []
    for c in configs:
        mc = model_config(c["size"], c.get("num_layers"))
        cfg = EngineConfig(dtype="bfloat16", kv_cache_dtype=c["kv_cache_dtype"], block_size=16,
                           quantization=c.get("quantization"),
                           max_num_seqs=c["max_num_seqs"], max_num_batched_tokens=c["max_num_batched_tokens"],
                           max_model_len=c["max_model_len"], tensor_parallel_size=c["tp"],
                           attention_backend=c.get("attention_backend", "auto"), compilation_cache_dir=None,
                           show_progress=False)
        mesh = cuda_mesh(c["tp"], ("data", "model"), (1, c["tp"]))
        runner = abstract_runner(mc, cfg, mesh, num_blocks=c["num_blocks"])
        variants = [tuple(v) for v in c["variants"]] if c.get("variants") else runner.variants()
        formats = sorted({a.format for a in jax.tree.leaves(runner.params, is_leaf=lambda a: isinstance(a, QArray))
                          if isinstance(a, QArray)})
        for v in variants:
            t0 = time.perf_counter()
            exe = compile_steps(runner, [v])[v]
            hlo = exe.runtime_executable().hlo_modules()[0].to_string()
            rec = dict(c, tokens=v[0], decode_only=v[1], backend=runner.backend, layers=mc.num_layers,
                       weight_formats=formats,
                       compile_s=round(time.perf_counter() - t0, 2), **memory(exe),
                       kernel_calls={t: hlo.count(f'custom_call_target="{t}"') for t in KERNEL_TARGETS},
                       collectives=sorted({op for op in ("all-reduce", "all-gather", "reduce-scatter",
                                                         "all-to-all", "collective-permute")
                                   if f" {op}(" in hlo or f" {op}-start(" in hlo}))
            if [v[0], v[1]] in [list(x) for x in c.get("cost_variants", [])]:
                t0 = time.perf_counter()
                rec.update(_costs(c, cfg, mesh, v, mc.num_layers), cost_compile_s=round(time.perf_counter() - t0, 2))
            out.append(rec)
    return out


if __name__ == "__main__":
    job, payload, out = sys.argv[1:4]
    with open(out, "w") as f:
        json.dump(globals()[job](**json.loads(payload)), f)
