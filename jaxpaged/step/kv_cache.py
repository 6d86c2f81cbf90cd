"""The KV cache's storage type (`kv_cache_dtype`): the pool as the model dtype, bfloat16, or quantized.

"auto" stores K/V in the model dtype, "bfloat16" in bfloat16. "int8" and "float8_e4m3fn" store them
quantized, symmetric, with one float32 scale per token per KV head (amax / 127 for int8, rounded to
nearest; amax / 448 for fp8 e4m3, so each head's row of head_dim values spans the format's range): a
quantized pool is a `QuantPool` of its values [L*N, bs, Hkv, hd] (int8 / fp8) and its scales
f32[L*N, bs, Hkv] in the same paged layout (block ids, offsets and the KV-head split are shared).
K/V are quantized where they are written (the decoder layer) and dequantized inside attention, which
folds the key scales into the logits and the value scales into the probabilities (see
docs/kernels.md). Per-token-per-head scales need no calibration and keep a new token's write local to
its own slot of the pool.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "bfloat16", "float8_e4m3fn", "int8")
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


class QuantPool(NamedTuple):
    """A quantized K or V pool: values [num_blocks, bs, Hkv, hd] int8/fp8, scale f32[num_blocks, bs, Hkv]."""
    values: jax.Array
    scale: jax.Array


def check_kv_cache_dtype(name) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {name!r}")


def storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype of the pool's values ("auto": the model dtype)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return jnp.dtype(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in _QMAX


def bytes_per_token_head(kv_cache_dtype: str, model_dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes in the pool, its scale included."""
    return head_dim * storage_dtype(kv_cache_dtype, model_dtype).itemsize + 4 * is_quantized(kv_cache_dtype)


def zeros_pool(shape, kv_cache_dtype: str, model_dtype):
    """An empty pool [num_blocks, bs, Hkv, hd]: an array, or a QuantPool (scales f32[num_blocks, bs, Hkv])."""
    values = jnp.zeros(shape, storage_dtype(kv_cache_dtype, model_dtype))
    return QuantPool(values, jnp.zeros(shape[:-1], jnp.float32)) if is_quantized(kv_cache_dtype) else values


def pool_values(pool) -> jax.Array:
    return pool.values if isinstance(pool, QuantPool) else pool


def quantize(x, dtype):
    """x [..., hd] -> (values [..., hd] of `dtype`, scale f32[...]): symmetric, one scale per row."""
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype.name]
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / qmax  # [...]
    y = xf / jnp.where(scale > 0, scale, 1.0)[..., None]
    if dtype == jnp.int8:
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    return y.astype(dtype), scale


def dequantize(values, scale, dtype=jnp.float32):
    """values [..., hd], scale [...] -> [..., hd] of `dtype` (an unquantized pool: scale None)."""
    x = values.astype(jnp.float32)
    return (x if scale is None else x * scale[..., None]).astype(dtype)


def write(pool, blk, off, x):
    """Write x [T, Hkv, hd] at (block blk[T], offset off[T]) of the pool, quantizing if it is quantized."""
    if isinstance(pool, QuantPool):
        values, scale = quantize(x, pool.values.dtype)
        return QuantPool(pool.values.at[blk, off].set(values), pool.scale.at[blk, off].set(scale))
    return pool.at[blk, off].set(x.astype(pool.dtype))


def attention_args(k_pool, v_pool) -> tuple:
    """(k_values, v_values, {k_scale, v_scale} or {}) for an attention function's call."""
    if isinstance(k_pool, QuantPool):
        return k_pool.values, v_pool.values, dict(k_scale=k_pool.scale, v_scale=v_pool.scale)
    return k_pool, v_pool, {}
