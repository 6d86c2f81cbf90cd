"""Paged decode attention: one query per slot, keys read through the block table.

Pool layout (every kernel shares it): ``k_pool``, ``v_pool``: ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A program handles one (slot, KV head, key split): the slot's query heads of that KV head
(GQA group, padded to 16 rows for the tensor cores) against ``blocks_per_iter`` blocks per step, with an
online softmax. Key splits (flash-decoding) divide each slot's *actual* context, not the table width, so
short contexts in a wide table stay balanced; their partial results are merged in plain JAX.

Backend: the Pallas Triton lowering (``interpret=True`` runs it on CPU). The public entry takes no
backend-specific argument besides the tuning knobs, so another implementation (Mosaic GPU) can slot in
behind the same signature.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a JAX without the (deprecated) Triton backend: only another backend can serve
    plgpu = None

from pallas_kernels.attention.api import QUANTIZED, check_options, check_pow2, pow2_ceil, validate, with_tuning
from pallas_kernels.attention.reference import paged_attention_reference

_NEG = -1e30
_LOG2E = math.log2(math.e)
_TARGET_PROGRAMS = 512  # enough (slot, head, split) programs to fill ~130 SMs a few times over


# JAX 0.11 deprecates the Pallas Triton backend and warns at every Triton lowering, which happens when the
# jit around the caller's step compiles, after our call has returned: a filter scoped to the call cannot see
# it. Triton stays the backend below sm_90 while JAX ships it, so the warning is ours to carry, not the
# user's; it is ignored process-wide (this message, this category only) once a Triton kernel is built.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


@functools.cache
def quiet_triton_deprecation() -> None:
    """Ignore JAX's Triton-deprecation DeprecationWarning from now on (idempotent)."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def compiler_params(num_warps: int, num_stages: int):
    """Triton compiler parameters (the class was renamed across JAX releases)."""
    if plgpu is None:
        raise NotImplementedError("this JAX has no Pallas Triton backend; use the reference attention")
    quiet_triton_deprecation()
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def pad_table(block_tables, blocks_per_iter):
    """Pad the columns to a multiple of blocks_per_iter with the null block."""
    pad = -block_tables.shape[1] % blocks_per_iter
    return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def online_softmax_step(q, k, v, visible, carry, scale, softcap=None, k_scale=None, v_scale=None):
    """One block of keys into the running (m, l, acc); logits in base 2, soft-capped when asked.

    q: [M, D]; k, v: [K, D]; visible: bool broadcastable to [M, K]; carry: m [M], l [M], acc [M, D] (f32).
    k_scale, v_scale: f32[1, K] dequantization scales of the keys (multiply the logits) and the values
    (multiply the probabilities; zero where not visible), or None.
    """
    m, l, acc = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [M, K]
    if k_scale is not None:
        s = s * k_scale
    if softcap is None:
        s = s * (scale * _LOG2E)
    else:
        s = jnp.tanh(s * (scale / softcap)) * (softcap * _LOG2E)
    s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)  # [M, K]
    alpha = jnp.exp2(m - m_new)
    pv = lax.dot_general((p if v_scale is None else p * v_scale).astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)  # [M, D]
    return m_new, l * alpha + p.sum(axis=1), acc * alpha[:, None] + pv


def _decode_kernel(lens_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
                   scale, blocks_per_iter, num_splits, window, softcap, quantized):
    # lens_ref: i32[S]; tables_ref: i32[S, B] (B a multiple of blocks_per_iter)
    # q_ref: [M, D] queries of this slot and KV head (rows past the GQA group are padding)
    # k_ref, v_ref: [N, bs, Hkv, D] whole pools; refs: (ks_ref, vs_ref f32[N, bs, Hkv] when quantized),
    # o_ref [M, D], then (only when num_splits > 1) m_ref [M], l_ref [M]
    scale_refs, (o_ref, *stat_refs) = (refs[:2], refs[2:]) if quantized else ((), refs)
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    M, D = q_ref.shape
    bs = k_ref.shape[1]
    nb = blocks_per_iter
    kb = nb * bs
    length = lens_ref[s]
    n_iter = jnp.minimum(pl.cdiv(length, kb), tables_ref.shape[1] // nb)
    lowest = 0 if window is None else jnp.maximum(length - window, 0)  # first key in the window
    first = lowest // kb  # blocks wholly before the window are skipped
    per_split = pl.cdiv(jnp.maximum(n_iter - first, 0), num_splits)
    start = first + j * per_split
    stop = jnp.minimum(start + per_split, n_iter)
    q = q_ref[...]

    def body(i, carry):
        ids = tables_ref[s, pl.ds(i * nb, nb)]  # [nb]
        k = k_ref[ids, :, h, :].reshape(kb, D)  # [kb, D]
        v = v_ref[ids, :, h, :].reshape(kb, D)
        k_pos = i * kb + lax.broadcasted_iota(jnp.int32, (kb, 1), 0)  # [kb, 1]
        seen = (k_pos < length) & (k_pos >= lowest)  # [kb, 1]
        k, v, ks, vs = dequantize_block(k, v, ids, h, seen.reshape(1, kb), q.dtype, scale_refs)
        v = jnp.where(seen, v, 0)  # stale pool contents must not reach the output
        return online_softmax_step(q, k, v, seen.reshape(1, kb), carry, scale, softcap, ks, vs)

    init = (jnp.full((M,), _NEG, jnp.float32), jnp.zeros((M,), jnp.float32),
            jnp.zeros((M, D), jnp.float32))
    m, l, acc = lax.fori_loop(start, stop, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)  # empty: zeros
    if stat_refs:
        m_ref, l_ref = stat_refs
        m_ref[...] = m
        l_ref[...] = l


def dequantize_block(k, v, ids, h, seen, dtype, scale_refs):
    """Quantized pools: widen the gathered k, v [kb, D] to the dots' dtype and gather their scales
    f32[1, kb] (value scales zeroed where not `seen` [1, kb]). Else: (k, v, None, None) as they are."""
    if not scale_refs:
        return k, v, None, None
    ks_ref, vs_ref = scale_refs
    kb = k.shape[0]
    ks = ks_ref[ids, :, h].reshape(1, kb)
    vs = jnp.where(seen, vs_ref[ids, :, h].reshape(1, kb), 0.0)  # stale scales may be anything, even NaN
    return k.astype(dtype), v.astype(dtype), ks, vs


def decode_defaults(num_slots, num_kv_heads, head_dim, block_size, max_blocks):
    """Tuning defaults: ~64 keys per step (32 at head_dim 256), splits to fill the GPU.

    64 keys x 128 dims x bf16 with 4 warps compiles (Triton, sm_90) to ~128 registers and ~54 KiB of
    shared memory: four programs per SM, no spills; 128 keys halves that occupancy.
    """
    keys = 64 if head_dim <= 128 else 32
    nb = max(keys // block_size, pl.cdiv(16, block_size), 1)
    nb = min(nb, max(pow2_ceil(max_blocks), pl.cdiv(16, block_size)))
    iters = pl.cdiv(max_blocks, nb)
    splits = max(1, min(_TARGET_PROGRAMS // (num_slots * num_kv_heads), iters, 32))
    return dict(blocks_per_iter=nb, num_splits=splits, num_warps=4, num_stages=2)


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "softcap", "interpret", "blocks_per_iter", "num_splits", "num_warps", "num_stages"))
def _paged_attention(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale, *, scale, window, softcap,
                     interpret, blocks_per_iter, num_splits, num_warps, num_stages):
    S, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    M = max(16, pow2_ceil(G))
    quantized = k_scale is not None
    qg = q.astype(compute_dtype(q, k_pool)).reshape(S, Hkv, G, D)
    if M != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, M - G), (0, 0)))  # [S, Hkv, M, D]
    tables = pad_table(block_tables, blocks_per_iter)
    split = num_splits > 1
    whole = pl.no_block_spec
    row = lambda s, h, j: (s, h, 0, 0)
    if split:
        out_shape = [jax.ShapeDtypeStruct((num_splits, S, Hkv, M, D), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, S, Hkv, M), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, S, Hkv, M), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, M, D), lambda s, h, j: (j, s, h, 0, 0)),
                     pl.BlockSpec((None, None, None, M), lambda s, h, j: (j, s, h, 0)),
                     pl.BlockSpec((None, None, None, M), lambda s, h, j: (j, s, h, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((S, Hkv, M, D), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, M, D), row)]
    kernel = functools.partial(_decode_kernel, scale=scale, blocks_per_iter=blocks_per_iter,
                               num_splits=num_splits, window=window, softcap=softcap, quantized=quantized)
    scales = (k_scale, v_scale) if quantized else ()
    outs = pl.pallas_call(
        kernel,
        grid=(S, Hkv, num_splits),
        in_specs=[whole, whole, pl.BlockSpec((None, None, M, D), row), whole, whole] + [whole] * len(scales),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(seq_lens, tables, qg, k_pool, v_pool, *scales)
    if split:  # merge the key splits: weights l * 2^(m - max m)
        o, m, l = outs  # [J, S, Hkv, M, D], [J, S, Hkv, M], [J, S, Hkv, M]
        w = l * jnp.exp2(m - m.max(axis=0))
        out = (w[..., None] * o).sum(axis=0) / jnp.maximum(w.sum(axis=0), 1e-30)[..., None]
    else:
        out = outs[0]
    return out[:, :, :G].reshape(S, Hq, D).astype(q.dtype)


def compute_dtype(q, k_pool):
    """The dots' dtype: the pools' (q is cast to it), or q's for quantized pools (widened exactly:
    int8 and fp8 e4m3 values are exact in bfloat16 / float16)."""
    return q.dtype if jnp.dtype(k_pool.dtype) in QUANTIZED else k_pool.dtype


def paged_attention(q, k_pool, v_pool, block_tables, seq_lens, *, scale=None, window=None, softcap=None,
                    interpret=False, k_scale=None, v_scale=None, **tuning):
    """Decode attention over a paged KV pool: q [S, Hq, D] -> [S, Hq, D].

    Args:
      q: [num_slots, num_q_heads, head_dim], one query per slot (the slot's last token); cast to the
        pools' dtype for the dots, the output has q's dtype.
      k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim]; any num_blocks. int8 or
        float8_e4m3fn pools are quantized: their values are widened to q's dtype for the dots.
      block_tables: i32[num_slots, max_blocks]; padding entries point at the null block.
      seq_lens: i32[num_slots] keys visible to each slot's query; 0 = empty slot (returns zeros).
      scale: logit scale, default head_dim ** -0.5.
      window: sliding window (the query sees its last ``window`` keys; blocks before them are skipped),
        None for all keys.
      softcap: logits become ``softcap * tanh(logits / softcap)`` (after scaling); None for none.
      interpret: run the kernel in Pallas interpret mode (CPU).
      k_scale, v_scale: f32[num_blocks, block_size, num_kv_heads], the quantized pools' scales (one per
        token per KV head; dequantized = value * scale); None for float pools.
      **tuning: keyword-only knobs, defaults from ``decode_defaults``: ``blocks_per_iter`` (blocks
        per inner step, power of two), ``num_splits`` (key splits per slot), ``num_warps``,
        ``num_stages``.
    """
    block_tables, seq_lens = validate(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale)
    check_options(window, softcap)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} slots but block_tables has {block_tables.shape[0]} rows")
    knobs = with_tuning(decode_defaults(q.shape[0], k_pool.shape[2], q.shape[2], k_pool.shape[1],
                                        block_tables.shape[1]), tuning)
    check_pow2("blocks_per_iter", knobs["blocks_per_iter"], pl.cdiv(16, k_pool.shape[1]))
    if knobs["num_splits"] < 1:
        raise ValueError(f"num_splits must be >= 1, got {knobs['num_splits']}")
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _paged_attention(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale, scale=scale, window=window,
                            softcap=None if softcap is None else float(softcap),
                            interpret=bool(interpret), **knobs)


__all__ = ["paged_attention", "paged_attention_reference", "decode_defaults"]
