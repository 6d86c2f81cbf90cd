"""The contract every paged-attention implementation shares: its operands and their checks.

Operands (every backend): q [T, Hq, D] (T = slots for the decode entry points, packed rows for the ragged
ones); ``k_pool``, ``v_pool`` [num_blocks, block_size, num_kv_heads, head_dim] of one dtype; for int8 /
float8_e4m3fn pools, ``k_scale``, ``v_scale`` f32[num_blocks, block_size, num_kv_heads]; ``block_tables``
i32[S, max_blocks]; ``seq_lens`` i32[S]; ``query_start_loc`` i32[S + 1] (ragged). Options (keyword-only,
static): ``scale``, ``window``, ``softcap`` (pallas_kernels/attention/reference.py). Each check
raises ValueError naming the operand and what it must be.
"""
from __future__ import annotations

import jax.numpy as jnp

FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # q and unquantized pools
QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # pools with per-token scales


def check_heads(q, k_pool):
    if q.shape[-2] % k_pool.shape[2]:
        raise ValueError(
            f"num_q_heads ({q.shape[-2]}) must be a multiple of num_kv_heads ({k_pool.shape[2]})")


def check_scales(k_pool, v_pool, k_scale, v_scale):
    """Quantized pools (int8 / float8_e4m3fn) need both scale pools f32[num_blocks, bs, Hkv]; others none."""
    quantized = jnp.dtype(k_pool.dtype) in QUANTIZED
    if (k_scale is None) != (v_scale is None) or quantized != (k_scale is not None):
        raise ValueError(f"k_scale and v_scale must be given exactly when the pools are int8 or float8_e4m3fn "
                         f"(pools {k_pool.dtype}, k_scale {'given' if k_scale is not None else None}, "
                         f"v_scale {'given' if v_scale is not None else None})")
    if quantized:
        want = tuple(k_pool.shape[:3])
        for name, a in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(a.shape) != want or a.dtype != jnp.float32:
                raise ValueError(f"{name} must be float32{list(want)} (the pool's [num_blocks, block_size, "
                                 f"num_kv_heads]), got {a.dtype}{list(a.shape)}")


def check_query_start_loc(query_start_loc, num_slots: int) -> None:
    """ValueError unless query_start_loc is an integer array [num_slots + 1] (the ragged kernels' layout)."""
    if query_start_loc.shape != (num_slots + 1,) or not jnp.issubdtype(query_start_loc.dtype, jnp.integer):
        raise ValueError(f"query_start_loc must be integer [{num_slots + 1}] (num_slots + 1), got "
                         f"{query_start_loc.dtype}{list(query_start_loc.shape)}")


def with_tuning(defaults: dict, tuning: dict) -> dict:
    """A kernel's tuning knobs: its defaults overridden by `tuning`; ValueError naming any unknown knob."""
    unknown = set(tuning) - set(defaults)
    if unknown:
        raise ValueError(f"unknown tuning knobs {sorted(unknown)}; valid: {sorted(defaults)}")
    return {**defaults, **tuning}


def check_options(window, softcap):
    """Validate the shared keyword options; window and softcap must be static Python numbers."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def pow2_ceil(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def validate(q, k_pool, v_pool, block_tables, seq_lens, k_scale=None, v_scale=None):
    """Check shapes and dtypes shared by both kernels; return (block_tables, seq_lens) as int32."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError("k_pool and v_pool must both be [num_blocks, block_size, num_kv_heads, head_dim]"
                         f", got {k_pool.shape} and {v_pool.shape}")
    _, bs, hkv, d = k_pool.shape
    if q.shape[2] != d:
        raise ValueError(f"head_dim of q ({q.shape[2]}) differs from the pools' ({d})")
    if q.shape[1] % hkv:
        raise ValueError(f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({hkv})")
    if d != pow2_ceil(d) or not 16 <= d <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if bs != pow2_ceil(bs):
        raise ValueError(f"block_size must be a power of two, got {bs}")
    pools = FLOATS + QUANTIZED
    if jnp.dtype(q.dtype) not in FLOATS or jnp.dtype(k_pool.dtype) not in pools or k_pool.dtype != v_pool.dtype:
        raise ValueError("q must be float32, bfloat16 or float16, and k_pool and v_pool one of them or int8 / "
                         f"float8_e4m3fn, the same; got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    check_scales(k_pool, v_pool, k_scale, v_scale)
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables must be an integer [num_slots, max_blocks] array, got "
                         f"{block_tables.dtype}{list(block_tables.shape)}")
    if seq_lens.shape != block_tables.shape[:1] or not jnp.issubdtype(seq_lens.dtype, jnp.integer):
        raise ValueError(f"seq_lens must be integer [{block_tables.shape[0]}] (one per block-table row), "
                         f"got {seq_lens.dtype}{list(seq_lens.shape)}")
    return block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32)


def check_pow2(name: str, value: int, minimum: int = 1):
    if value != pow2_ceil(value) or value < minimum:
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
