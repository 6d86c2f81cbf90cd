"""Ragged paged attention: prefill chunks and decodes of many slots packed in one query array.

Slot i's queries are rows ``query_start_loc[i]:query_start_loc[i+1]`` and are the last tokens of its
``seq_lens[i]``-long context, causal. The packed rows are cut into tiles of ``block_q`` rows that never
cross a slot boundary (at most ``cdiv(T, block_q) + S`` tiles, computed in plain JAX); a program handles
one (tile, KV head): ``block_q x group`` query rows against the slot's keys up to the tile's last
position, ``blocks_per_iter`` blocks per step, online softmax. Rows past ``query_start_loc[S]`` are
padding and come back as zeros.

Backend: the Pallas Triton lowering, like the decode kernel (``triton_decode.py``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention.api import (
    check_options,
    check_pow2,
    check_query_start_loc,
    pow2_ceil,
    validate,
    with_tuning,
)
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from pallas_kernels.attention.triton_decode import (
    _NEG,
    compiler_params,
    compute_dtype,
    dequantize_block,
    online_softmax_step,
    pad_table,
    plgpu,
)


def _ragged_kernel(tiles_ref, tables_ref, q_ref, k_ref, v_ref, *refs, scale, block_q,
                   blocks_per_iter, window, softcap):
    # tiles_ref: i32[4, P] per tile: slot, first row, valid rows (0 = idle tile), position of first row
    # tables_ref: i32[S, B] (B a multiple of blocks_per_iter)
    # q_ref, o_ref: [T + block_q, Hkv, Gp, D] whole arrays (rows padded so every tile slice is in bounds)
    # k_ref, v_ref: [N, bs, Hkv, D] whole pools; refs: (ks_ref, vs_ref f32[N, bs, Hkv] when quantized), o_ref
    *scale_refs, o_ref = refs
    p, h = pl.program_id(0), pl.program_id(1)
    _, _, Gp, D = q_ref.shape
    M = block_q * Gp
    bs = k_ref.shape[1]
    nb = blocks_per_iter
    kb = nb * bs
    slot, row0, n_rows, pos0 = tiles_ref[0, p], tiles_ref[1, p], tiles_ref[2, p], tiles_ref[3, p]
    kv_len = jnp.where(n_rows > 0, pos0 + n_rows, 0)  # keys visible to the tile's last row
    n_iter = jnp.minimum(pl.cdiv(jnp.maximum(kv_len, 0), kb), tables_ref.shape[1] // nb)
    lowest = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)  # first key of the first row's window
    q = q_ref[pl.ds(row0, block_q), h, :, :].reshape(M, D)  # row r*Gp+g: token r, head g
    q_pos = pos0 + lax.broadcasted_iota(jnp.int32, (M, 1), 0) // Gp  # [M, 1]

    def body(i, carry):
        ids = tables_ref[slot, pl.ds(i * nb, nb)]  # [nb]
        k = k_ref[ids, :, h, :].reshape(kb, D)  # [kb, D]
        v = v_ref[ids, :, h, :].reshape(kb, D)
        k_pos = i * kb + lax.broadcasted_iota(jnp.int32, (kb, 1), 0)  # [kb, 1]
        seen = (k_pos < kv_len) & (k_pos >= lowest)  # [kb, 1]
        k, v, ks, vs = dequantize_block(k, v, ids, h, seen.reshape(1, kb), q.dtype, scale_refs)
        v = jnp.where(seen, v, 0)  # stale contents must not reach the output
        visible = k_pos.reshape(1, kb) <= q_pos  # [M, kb] causal
        if window is not None:
            visible &= k_pos.reshape(1, kb) > q_pos - window
        return online_softmax_step(q, k, v, visible, carry, scale, softcap, ks, vs)

    init = (jnp.full((M,), _NEG, jnp.float32), jnp.zeros((M,), jnp.float32),
            jnp.zeros((M, D), jnp.float32))
    _, l, acc = lax.fori_loop(jnp.minimum(lowest // kb, n_iter), n_iter, body, init)  # skip blocks before the window
    out = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype).reshape(block_q, Gp, D)
    rows = lax.broadcasted_iota(jnp.int32, (block_q, Gp, D), 0)
    plgpu.store(o_ref.at[pl.ds(row0, block_q), h, :, :], out, mask=rows < n_rows)


def tile_layout(query_start_loc, seq_lens, num_tokens, block_q):
    """i32[4, cdiv(T, block_q) + S]: per tile slot, first row, valid rows, position of the first row.

    Tiles are cut per slot, so none crosses a slot boundary; tiles past the last slot's are idle (0 rows).
    """
    S = seq_lens.shape[0]
    q_lens = jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)  # [S]
    n_tiles = pl.cdiv(q_lens, block_q)
    ends = jnp.cumsum(n_tiles)  # [S] inclusive
    P = pl.cdiv(num_tokens, block_q) + S
    t = jnp.arange(P, dtype=jnp.int32)
    slot = jnp.minimum(jnp.searchsorted(ends, t, side="right"), S - 1).astype(jnp.int32)  # [P]
    row0 = query_start_loc[slot] + (t - (ends[slot] - n_tiles[slot])) * block_q
    n_rows = jnp.clip(query_start_loc[slot + 1] - row0, 0, block_q)
    valid = (t < ends[S - 1]) & (row0 < num_tokens)
    pos0 = seq_lens[slot] - (query_start_loc[slot + 1] - row0)
    return jnp.stack([slot, jnp.where(valid, row0, 0), jnp.where(valid, n_rows, 0),
                      jnp.where(valid, pos0, 0)]).astype(jnp.int32)


def ragged_defaults(num_q_heads, num_kv_heads, head_dim, block_size, max_blocks):
    """Tuning defaults: ~64 query rows (tokens x GQA group) and ~64 keys per step (32 at head_dim 256)."""
    Gp = pow2_ceil(num_q_heads // num_kv_heads)
    rows = 64 if head_dim <= 128 else 32
    keys = 64 if head_dim <= 128 else 32
    nb = max(keys // block_size, pl.cdiv(16, block_size), 1)
    nb = min(nb, max(pow2_ceil(max_blocks), pl.cdiv(16, block_size)))
    return dict(block_q=max(rows // Gp, pl.cdiv(16, Gp)), blocks_per_iter=nb, num_warps=4, num_stages=2)


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "softcap", "interpret", "block_q", "blocks_per_iter", "num_warps", "num_stages"))
def _ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, k_scale, v_scale, *,
                            scale, window, softcap, interpret, block_q, blocks_per_iter, num_warps, num_stages):
    T, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    Gp = pow2_ceil(G)
    qg = jnp.pad(q.astype(compute_dtype(q, k_pool)).reshape(T, Hkv, G, D),
                 ((0, block_q), (0, 0), (0, Gp - G), (0, 0)))
    scales = () if k_scale is None else (k_scale, v_scale)
    tiles = tile_layout(query_start_loc, seq_lens, T, block_q)  # [4, P]
    whole = pl.no_block_spec
    kernel = functools.partial(_ragged_kernel, scale=scale, block_q=block_q,
                               blocks_per_iter=blocks_per_iter, window=window, softcap=softcap)
    out = pl.pallas_call(
        kernel,
        grid=(tiles.shape[1], Hkv),
        in_specs=[whole] * (5 + len(scales)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(tiles, pad_table(block_tables, blocks_per_iter), qg, k_pool, v_pool, *scales)
    valid = jnp.arange(T) < query_start_loc[-1]  # rows no tile wrote hold garbage: zero them
    out = jnp.where(valid[:, None, None, None], out[:T, :, :G], 0)
    return out.reshape(T, Hq, D).astype(q.dtype)


def ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale=None,
                           window=None, softcap=None, interpret=False, k_scale=None, v_scale=None, **tuning):
    """Mixed prefill/decode attention over a paged KV pool: q [T, Hq, D] -> [T, Hq, D].

    Args:
      q: [num_tokens, num_q_heads, head_dim], queries of all slots packed by ``query_start_loc``; cast to
        the pools' dtype for the dots, the output has q's dtype.
      k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim]; any num_blocks. int8 or
        float8_e4m3fn pools are quantized: their values are widened to q's dtype for the dots.
      block_tables: i32[num_slots, max_blocks]; padding entries point at the null block.
      seq_lens: i32[num_slots] context length of each slot, its queries included.
      query_start_loc: i32[num_slots + 1] nondecreasing; slot i's queries are the last
        ``query_start_loc[i+1] - query_start_loc[i]`` tokens of its context; rows from
        ``query_start_loc[-1]`` on are padding (zeros out).
      scale: logit scale, default head_dim ** -0.5.
      window: sliding window (a query at position p sees keys p - window < k <= p; each tile skips the
        blocks wholly before its first query's window), None for causal attention over all keys.
      softcap: logits become ``softcap * tanh(logits / softcap)`` (after scaling); None for none.
      interpret: run the kernel in Pallas interpret mode (CPU).
      k_scale, v_scale: f32[num_blocks, block_size, num_kv_heads], the quantized pools' scales; None for
        float pools.
      **tuning: keyword-only knobs, defaults from ``ragged_defaults``: ``block_q`` (query tokens per
        program, power of two), ``blocks_per_iter`` (blocks per inner step, power of two),
        ``num_warps``, ``num_stages``.
    """
    block_tables, seq_lens = validate(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale)
    check_options(window, softcap)
    check_query_start_loc(query_start_loc, block_tables.shape[0])
    Hq, Hkv = q.shape[1], k_pool.shape[2]
    knobs = with_tuning(ragged_defaults(Hq, Hkv, q.shape[2], k_pool.shape[1], block_tables.shape[1]), tuning)
    check_pow2("block_q", knobs["block_q"], pl.cdiv(16, pow2_ceil(Hq // Hkv)))
    check_pow2("blocks_per_iter", knobs["blocks_per_iter"], pl.cdiv(16, k_pool.shape[1]))
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens,
                                   query_start_loc.astype(jnp.int32), k_scale, v_scale, scale=scale, window=window,
                                   softcap=None if softcap is None else float(softcap),
                                   interpret=bool(interpret), **knobs)


__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "ragged_defaults"]
