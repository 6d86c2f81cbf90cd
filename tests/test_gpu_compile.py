"""Compiled for an H100 / H200 (sm_90a) on this CPU-only machine: both kernel backends and the engine's
whole step, through the jax-cuda plugin's compile-only client and ptxas (jaxpaged/bench/gpu_compile.py).

Every compile runs in a fresh ``JAX_PLATFORMS=cpu`` subprocess, so this process never starts the CUDA
plugin. Skips with the reason when the plugin or ptxas is not installed (the ``test`` extra brings both).
The full table (every model shape x KV dtype x backend) is ``jaxpaged/bench/gpu_compile_table.py``'s.
"""
from __future__ import annotations

import os
import warnings

import pytest

from jaxpaged.bench import gpu_compile

SMEM_PER_BLOCK = 232448  # sm_90a's opt-in shared memory per block (the spec's shared_memory_per_block_optin)
needs_toolchain = pytest.mark.skipif(gpu_compile.missing() is not None, reason=str(gpu_compile.missing()))


def _case(backend, kernel, kv, hq, hkv, head_dim, **kw):
    return dict(dict(backend=backend, kernel=kernel, kv=kv, hq=hq, hkv=hkv, head_dim=head_dim, block_size=16,
                     slots=64, max_blocks=128, num_blocks=4096, tokens=256), **kw)


@needs_toolchain
def test_kernels_compile_for_sm90a():
    """The default model's shape (9 q / 3 kv heads, head_dim 64) in bf16 and Llama-3-8B's (32 / 8, 128) with
    int8 and fp8 pools, both kernels, both backends: real cubins, within sm_90a's limits."""
    cases = [_case(b, k, "bfloat16", 9, 3, 64) for b in ("triton", "mosaic") for k in ("decode", "ragged")]
    cases += [_case(b, k, kv, 32, 8, 128) for b, k, kv in [("mosaic", "decode", "int8"), ("mosaic", "ragged",
              "float8_e4m3fn"), ("triton", "decode", "float8_e4m3fn"), ("triton", "ragged", "int8")]]
    got = gpu_compile.run("kernels", dict(cases=cases))
    assert len(got) == len(cases)
    for rec in got:
        label = f"{rec['backend']} {rec['kernel']} {rec['kv']} {rec['hq']}/{rec['hkv']}x{rec['head_dim']}"
        assert rec["target"] == "sm_90a", label
        assert 0 < rec["registers"] <= 255, label
        assert 0 < rec["smem_bytes"] <= SMEM_PER_BLOCK, label


@needs_toolchain
def test_oversized_tuning_fails_like_a_real_h100():
    """The compile is real: shared memory beyond sm_90a's 227 KiB a block is refused, by XLA for the Triton
    kernel (as on the device), by Mosaic GPU's lowering for its kernel."""
    big = dict(backend="mosaic", kernel="decode", kv="bfloat16", hq=32, hkv=8, head_dim=256, block_size=16,
               slots=8, max_blocks=64, num_blocks=1024, tokens=64, tuning=dict(num_stages=8, blocks_per_iter=4))
    too_big = "exceeds available shared memory: smem_bytes=\\d+ > max_smem_bytes=232448"
    with pytest.raises(RuntimeError, match=too_big):
        gpu_compile.run("kernels", dict(cases=[big]))
    big.update(backend="triton", tuning=dict(num_stages=4, blocks_per_iter=32, num_splits=1))
    with pytest.raises(RuntimeError, match="Shared memory size limit exceeded: requested \\d+, available: 232448"):
        gpu_compile.run("kernels", dict(cases=[big]))


@needs_toolchain
@pytest.mark.parametrize("tp, variant, quantization", [(1, [8, True], None), (8, [16, False], "int4")])
def test_whole_step_compiles_for_h100(tp, variant, quantization):
    """The engine's whole jitted step (jaxpaged/step/aot.py), Llama-3-8B-shaped (2 of its 32 layers: the
    layer scan compiles one body whatever the depth), for one H100 with bfloat16 weights and for an 8-device
    H100 topology (tensor parallelism, with its collectives) with int4 group-32 weights (XLA's
    dequantize-then-dot): the Mosaic GPU kernel inside, the pools updated in place. Every bucket at full
    depth is jaxpaged/bench/gpu_compile_table.py's."""
    cfg = dict(config="test", size="8B", num_layers=2, tp=tp, kv_cache_dtype="auto", quantization=quantization,
               max_num_seqs=16,
               max_num_batched_tokens=32, max_model_len=1024, num_blocks=256, variants=[variant])
    (rec,) = gpu_compile.run("steps", dict(configs=[cfg]))
    assert rec["backend"] == "mosaic_gpu" and rec["kernel_calls"]["mosaic_gpu_v2"] >= 1
    pool = 2 * 256 * 16 * (8 // tp) * 128 * 2 * 2  # K and V, 2 layers, the device's KV heads, bf16
    assert rec["alias_bytes"] >= pool  # both pools donated: updated in place
    assert rec["argument_bytes"] > pool and rec["temp_bytes"] > 0
    assert bool(rec["collectives"]) == (tp > 1)  # the sharded step reduces across devices
    # int4 layer matrices; the embedding / lm_head stay int8 (models/quant.py)
    assert rec["weight_formats"] == (["int4", "int8"] if quantization else []), rec["weight_formats"]


def test_triton_deprecation_is_quiet_for_users():
    """JAX 0.11's Triton-deprecation warning (raised when the caller's jit lowers the kernel) is filtered,
    that message only."""
    from pallas_kernels.attention.triton_decode import quiet_triton_deprecation
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_triton_deprecation.cache_clear()
        quiet_triton_deprecation()
        warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future JAX version.",
                      DeprecationWarning)
        warnings.warn("something else", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["something else"]


def test_gpu_check_script_dry_runs(tmp_path):
    """scripts/gpu_check.sh parses, and DRY_RUN=1 lays out its parts (both backends' kernels in bf16 and fp8,
    the engine per backend and KV dtype) without running any."""
    import subprocess
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_check.sh")
    subprocess.run(["bash", "-n", script], check=True)
    out = subprocess.run(["bash", script, str(tmp_path)], env=dict(os.environ, DRY_RUN="1"), capture_output=True,
                         text=True, check=True).stdout
    for backend in ("triton", "mosaic"):
        assert f"--backend {backend} --out" in out and f"--backend {backend} --kv-dtype float8_e4m3fn" in out
    for backend in ("triton", "mosaic_gpu"):
        for kv in ("auto", "float8_e4m3fn"):
            assert "--running 1 64 256" in out and f"--kv-cache-dtype {kv} --attention-backend {backend}" in out
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
