"""The CPU paged attention kernel (cpu.cc beside this file): built at first use by the FFI loader
(pallas_kernels/ffi), called through the XLA FFI.

`cpu_ragged_paged_attention` has the signature and semantics of
`reference.ragged_paged_attention_reference` and reads the K/V pool in place (the handler gets the pool's
buffer). `available()` is False (with one log line saying why) when there is no compiler or the build
fails; the attention backend then resolves to the reference. Quantized pools (int8 / fp8 with k_scale,
v_scale) and pool dtypes other than float32 / bfloat16 take the reference (pallas_kernels/attention/
backends.py keeps `attention_backend="auto"` from choosing this kernel for them).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.api import FLOATS, QUANTIZED, check_options, check_scales
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from pallas_kernels.ffi import load_kernel

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu.cc")
TARGET = "jaxpaged_cpu_paged_attention"
POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # what the kernel reads; others: reference
VECTOR_BLOCK_SIZE = 128  # the vector path's largest block_size (cpu.cc); larger blocks run the plain loops


@functools.cache
def _library():
    """The attention kernel's library, built and registered once; None when it cannot be here."""
    return load_kernel(SOURCE, "JaxpagedCpuPagedAttention", TARGET, "the reference attention")


def available() -> bool:
    """The kernel is built, loaded and registered here."""
    return _library() is not None


def vector_lanes() -> int:
    """The float32 lanes of the kernel's vector path in this build: 16 (AVX-512 F, BW, VL), 8 (AVX2 + FMA);
    0 when it has only the plain-loop path (slower than the reference) or is not available."""
    lib = _library()
    return int(lib.JaxpagedCpuAttentionVectorized()) if lib is not None else 0


def bf16_dots() -> bool:
    """The kernel takes a bfloat16 pool's logits by AVX-512 BF16 dot products here (vdpbf16ps, queries split
    into bfloat16 hi + lo); False: the pool's rows widened to float32 lanes (or the kernel is not available)."""
    lib = _library()
    return lib is not None and bool(lib.JaxpagedCpuAttentionBf16Dots())


def vectorized() -> bool:
    """The kernel has its vector path here: the one `attention_backend="auto"` picks on CPU targets."""
    return vector_lanes() > 0


def _integer(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.integer)


def check_operands(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc):
    """ValueError naming the first operand whose dtype or shape does not fit the others (the checks cpu.cc's
    handler repeats at the FFI boundary): q [T, Hq, D], pools [num_blocks, block_size, Hkv, D] alike with
    Hkv dividing Hq, block_tables [S, B], seq_lens [S], query_start_loc [S + 1]."""
    if q.ndim != 3 or q.shape[2] <= 0 or jnp.dtype(q.dtype) not in FLOATS:
        raise ValueError(f"q must be float32 / bfloat16 / float16 [T, Hq, D > 0], got {q.dtype}{list(q.shape)}")
    T, Hq, D = q.shape
    if (k_pool.ndim != 4 or min(k_pool.shape[:3]) <= 0 or k_pool.shape[3] != D or Hq % k_pool.shape[2]
            or jnp.dtype(k_pool.dtype) not in FLOATS + QUANTIZED):
        raise ValueError(f"k_pool must be [num_blocks, block_size, num_kv_heads, head_dim = {D}] (sizes > 0, "
                         f"num_kv_heads dividing q's {Hq} heads) of a float or int8 / float8_e4m3fn dtype, got "
                         f"{k_pool.dtype}{list(k_pool.shape)}")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool must have k_pool's dtype and shape {k_pool.dtype}{list(k_pool.shape)}, got "
                         f"{v_pool.dtype}{list(v_pool.shape)}")
    if block_tables.ndim != 2 or block_tables.shape[1] <= 0 or not _integer(block_tables):
        raise ValueError(f"block_tables must be integer [S, B > 0], got {block_tables.dtype}{list(block_tables.shape)}")
    S = block_tables.shape[0]
    if seq_lens.shape != (S,) or not _integer(seq_lens):
        raise ValueError(f"seq_lens must be integer [{S}] (one per block_tables row), got "
                         f"{seq_lens.dtype}{list(seq_lens.shape)}")
    if query_start_loc.shape != (S + 1,) or not _integer(query_start_loc):
        raise ValueError(f"query_start_loc must be integer [{S + 1}] (block_tables rows + 1), got "
                         f"{query_start_loc.dtype}{list(query_start_loc.shape)}")


def cpu_ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale=None,
                               window=None, softcap=None, k_scale=None, v_scale=None):
    """Mixed prefill/decode attention over packed queries q [T, Hq, D] -> [T, Hq, D] in q's dtype, the
    reference's semantics; the kernel for float32 / bfloat16 pools, the reference otherwise. ValueError
    naming the operand whose shape or dtype does not fit (`check_operands`)."""
    check_operands(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    check_options(window, softcap)
    if (k_scale is not None or jnp.dtype(k_pool.dtype) not in POOL_DTYPES or v_pool.dtype != k_pool.dtype
            or not available()):
        return ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc,
                                                scale=scale, window=window, softcap=softcap, k_scale=k_scale,
                                                v_scale=v_scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pool, v_pool, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
               query_start_loc.astype(jnp.int32), scale=np.float32(scale), window=np.int64(window or 0),
               softcap=np.float32(softcap or 0.0))  # [T, Hq, D] float32
    return out.astype(q.dtype)
