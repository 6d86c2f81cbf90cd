"""Ragged paged attention for TPU (Pallas Mosaic TPU): decodes and prefill chunks packed in one query array.

Same contract as ``ragged_paged_attention`` (pool ``[num_blocks, block_size, num_kv_heads, head_dim]``
per K and V, slot i's queries are rows ``query_start_loc[i]:query_start_loc[i+1]``, the last tokens of
its ``seq_lens[i]``-long context; padding rows come back as zeros), written for the TPU's memory
hierarchy:

- A program owns ``block_q`` consecutive query rows (a fixed block of the token axis, so each output
  block is written once, by one program) and every KV head. It walks the slots whose rows meet its
  block; for each, it copies the slot's blocks from HBM to VMEM, ``blocks_per_iter`` blocks a chunk,
  double-buffered (chunk c+1 is in flight while chunk c is computed), from the block tables held in
  SMEM (scalar prefetch).
- The pool is read in its own layout (any reshape of it would be a relayout of the whole pool on TPU,
  whose tiles span the (heads, head_dim) dimensions): a copy moves one whole block ``[block_size, Hkv, D]``
  (a TPU copy cannot start inside a tile, so not one head), and head h is every Hkv-th row of the
  chunk's tiles, a strided load from VMEM. A single KV head (``[N, bs, 1, D]``) is passed as ``[N, bs, D]``,
  the layout XLA gives it.
- Query rows are laid out per KV head, ``[Hkv, T * G, D]`` (row r*G + g: token r, q head g of the
  group), so a head's rows are one ``[block_q * G, D]`` matrix against the chunk's ``[K, D]`` keys.
- Online softmax in float32 (running max and sum in VMEM scratch, 128 lanes wide); a row that sees no
  key keeps a zero sum and comes back as 0. Keys outside a row's causal / window range are masked in
  the logits and in the values (stale pool contents, even NaN, never reach the output).
- Quantized pools (int8 / float8_e4m3fn) bring their scale blocks ``[block_size, Hkv]`` along; keys
  and values are dequantized in VMEM (``x * scale`` in float32, then cast to the compute dtype).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.api import QUANTIZED, check_options, check_scales, with_tuning

_NEG = -1e30
_LANES = 128


def _kernel(tables_ref, lens_ref, qsl_ref, first_ref, q_ref, k_hbm, v_hbm, *refs, scale, window, softcap,
            block_q, group, blocks_per_iter, quantized, cdt):
    # tables_ref i32[S, B], lens_ref i32[S], qsl_ref i32[S + 1], first_ref i32[P] (SMEM, scalar prefetch)
    # q_ref, o_ref: [Hkv, R, D] (R = block_q * G rows of this program, per KV head)
    # k_hbm, v_hbm: [N, bs, Hkv, D] pools in HBM ([N, bs, D] when Hkv == 1); with `quantized`, ks_hbm, vs_hbm
    # f32[N, bs, Hkv]
    # scratch: kbuf, vbuf [2, nb, bs, Hkv, D] ([2, nb, bs, D]); (ksbuf, vsbuf f32[2, nb, bs, Hkv]); sems DMA[2];
    #          m_ref, l_ref f32[Hkv, R, 128]; acc_ref f32[Hkv, R, D]
    if quantized:
        ks_hbm, vs_hbm, o_ref, kbuf, vbuf, ksbuf, vsbuf, sems, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref = refs
    Hkv, R, D = q_ref.shape
    nb, bs = kbuf.shape[1:3]
    K = nb * bs  # keys a chunk
    S, B = tables_ref.shape
    i = pl.program_id(0)
    r0 = i * block_q  # first token row of this program
    end = jnp.minimum(r0 + block_q, qsl_ref[S])  # rows past the last slot's are padding

    m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def copies(s, c, b, kv_end):
        """The DMAs of chunk c of slot s into buffer b (blocks past the slot's keys read the null block)."""
        out = []
        for j in range(nb):
            col = c * nb + j
            bid = jnp.where(col * bs < kv_end, tables_ref[s, jnp.minimum(col, B - 1)], 0)
            pairs = [(k_hbm, kbuf), (v_hbm, vbuf)] + ([(ks_hbm, ksbuf), (vs_hbm, vsbuf)] if quantized else [])
            out += [pltpu.make_async_copy(src.at[bid], dst.at[b, j], sems.at[b]) for src, dst in pairs]
        return out

    def chunk_keys(buf, b, h):
        """Head h's keys (or values) of chunk b: [K, D]; quantized values (and 16-bit blocks of fewer than 16
        rows, which would not merge into whole tiles) widened to float32."""
        x = buf[b] if Hkv == 1 else buf[b, :, :, h, :]  # [nb, bs, D]: every Hkv-th row of the tiles
        if quantized or x.dtype.itemsize * bs < 32:
            x = x.astype(jnp.float32)
        return x.reshape(K, D)

    def attend(s, c, b, lo, hi):
        """Chunk c (buffer b) of slot s into the sums of token rows lo..hi-1 of this program."""
        seq_end = qsl_ref[s + 1]
        tok = r0 + lax.broadcasted_iota(jnp.int32, (R, 1), 0) // group  # [R, 1]
        q_pos = lens_ref[s] - (seq_end - tok)  # [R, 1] each row's position in its slot
        k_pos = c * K + lax.broadcasted_iota(jnp.int32, (1, K), 1)  # [1, K]
        visible = (tok >= lo) & (tok < hi) & (k_pos <= q_pos)  # [R, K]
        if window is not None:
            visible &= k_pos > q_pos - window
        kv_end = lens_ref[s] - (seq_end - hi)
        key_ok = c * K + lax.broadcasted_iota(jnp.int32, (K, 1), 0) < kv_end  # [K, 1]
        for h in range(Hkv):
            k, v = chunk_keys(kbuf, b, h), chunk_keys(vbuf, b, h)  # [K, D]
            if quantized:
                k = k * ksbuf[b].reshape(K, Hkv)[:, h:h + 1]
                v = v * vsbuf[b].reshape(K, Hkv)[:, h:h + 1]
            v = jnp.where(key_ok, v, 0).astype(cdt)  # stale contents must not reach the output
            logits = lax.dot_general(q_ref[h], k.astype(cdt), (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * scale  # [R, K]
            if softcap is not None:
                logits = softcap * jnp.tanh(logits / softcap)
            logits = jnp.where(visible, logits, _NEG)
            m_prev = m_ref[h][:, :1]  # [R, 1]
            m_new = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)  # [R, K]
            alpha = jnp.exp(m_prev - m_new)
            l_new = alpha * l_ref[h][:, :1] + p.sum(axis=1, keepdims=True)
            pv = jnp.dot(p.astype(cdt), v, preferred_element_type=jnp.float32)  # [R, D]
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_new, (R, _LANES))
            l_ref[h] = jnp.broadcast_to(l_new, (R, _LANES))

    def slot_body(s):
        lo, hi = jnp.maximum(qsl_ref[s], r0), jnp.minimum(qsl_ref[s + 1], end)  # this slot's rows here
        kv_end = lens_ref[s] - (qsl_ref[s + 1] - hi)  # keys seen by the last of them
        first = 0
        if window is not None:  # blocks wholly before the first row's window are never read
            first = jnp.maximum(lens_ref[s] - (qsl_ref[s + 1] - lo) - window + 1, 0) // K
        last = jnp.where(hi > lo, pl.cdiv(kv_end, K), first)

        @pl.when(first < last)
        def _():
            for cp in copies(s, first, 0, kv_end):
                cp.start()

        def chunk(c, b):
            @pl.when(c + 1 < last)
            def _():
                for cp in copies(s, c + 1, 1 - b, kv_end):
                    cp.start()
            for cp in copies(s, c, b, kv_end):
                cp.wait()
            attend(s, c, b, lo, hi)
            return 1 - b

        lax.fori_loop(first, last, chunk, 0)
        return s + 1

    lax.while_loop(lambda s: (s < S) & (qsl_ref[jnp.minimum(s, S - 1)] < end), slot_body, first_ref[i])
    l = l_ref[...][:, :, :1]  # [Hkv, R, 1]
    o_ref[...] = (acc_ref[...] / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "interpret", "block_q",
                                             "blocks_per_iter"))
def _mosaic_tpu_ragged(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, k_scale, v_scale, *,
                       scale, window, softcap, interpret, block_q, blocks_per_iter):
    T, Hq, D = q.shape
    N, bs, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    quantized = k_scale is not None
    cdt = jnp.float32 if q.dtype == jnp.float32 or k_pool.dtype == jnp.float32 else jnp.bfloat16
    P = pl.cdiv(T, block_q)
    Tp = P * block_q
    R = block_q * G
    qg = jnp.pad(q.astype(cdt), ((0, Tp - T), (0, 0), (0, 0))).reshape(Tp, Hkv, G, D)
    qg = qg.transpose(1, 0, 2, 3).reshape(Hkv, Tp * G, D)  # [Hkv, Tp * G, D]
    first = jnp.searchsorted(query_start_loc[1:], jnp.arange(P, dtype=jnp.int32) * block_q,
                             side="right").astype(jnp.int32)  # [P] first slot meeting each block
    pools = [k_pool, v_pool] if Hkv > 1 else [k_pool.reshape(N, bs, D), v_pool.reshape(N, bs, D)]
    scratch = [pltpu.VMEM((2, blocks_per_iter) + pools[0].shape[1:], k_pool.dtype)] * 2
    if quantized:
        pools += [k_scale, v_scale]
        scratch += [pltpu.VMEM((2, blocks_per_iter, bs, Hkv), jnp.float32)] * 2
    scratch += [pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((Hkv, R, _LANES), jnp.float32),
                pltpu.VMEM((Hkv, R, _LANES), jnp.float32), pltpu.VMEM((Hkv, R, D), jnp.float32)]
    rows = pl.BlockSpec((Hkv, R, D), lambda i, *_: (0, i, 0))
    kernel = functools.partial(_kernel, scale=scale, window=window, softcap=softcap, block_q=block_q,
                               group=G, blocks_per_iter=blocks_per_iter, quantized=quantized, cdt=cdt)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(P,), in_specs=[rows] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools),
            out_specs=rows, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="mosaic_tpu_ragged_paged_attention",
    )(block_tables, seq_lens, query_start_loc, first, qg, *pools)
    out = out.reshape(Hkv, Tp, G, D).transpose(1, 0, 2, 3)[:T]  # [T, Hkv, G, D]
    return out.reshape(T, Hq, D)


_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def tpu_defaults(num_tokens, num_slots, block_size):
    """Tuning defaults: 16 query rows a program when most rows are decodes (T <= S), else 32; 128 keys a
    chunk (at least one block)."""
    return dict(block_q=16 if num_tokens <= num_slots else 32, blocks_per_iter=max(1, 128 // block_size))


def _validate(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, k_scale, v_scale):
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError("k_pool and v_pool must both be [num_blocks, block_size, num_kv_heads, head_dim] of one "
                         f"dtype, got {k_pool.dtype}{list(k_pool.shape)} and {v_pool.dtype}{list(v_pool.shape)}")
    _, bs, hkv, d = k_pool.shape
    if q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"q [{', '.join(map(str, q.shape))}] must have the pools' head_dim ({d}) and a multiple "
                         f"of num_kv_heads ({hkv}) heads")
    if d not in (64, 128, 256):
        raise ValueError(f"head_dim must be 64, 128 or 256 on TPU, got {d}")
    if bs % 8:
        raise ValueError(f"block_size must be a multiple of 8 on TPU, got {bs}")
    if jnp.dtype(q.dtype) not in _FLOATS or jnp.dtype(k_pool.dtype) not in _FLOATS + QUANTIZED:
        raise ValueError(f"q must be float32 or bfloat16 and the pools float32, bfloat16, int8 or float8_e4m3fn; "
                         f"got {q.dtype} and {k_pool.dtype}")
    check_scales(k_pool, v_pool, k_scale, v_scale)
    S = block_tables.shape[0]
    for name, a, shape in (("block_tables", block_tables, block_tables.shape), ("seq_lens", seq_lens, (S,)),
                           ("query_start_loc", query_start_loc, (S + 1,))):
        if a.shape != shape or a.ndim != len(shape) or not jnp.issubdtype(a.dtype, jnp.integer) or a.ndim < 1:
            raise ValueError(f"{name} must be integer {list(shape)} (block_tables [num_slots, max_blocks]), "
                             f"got {a.dtype}{list(a.shape)}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_slots, max_blocks], got shape {block_tables.shape}")


def mosaic_tpu_ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *,
                                      scale=None, window=None, softcap=None, interpret=False, k_scale=None,
                                      v_scale=None, **tuning):
    """Mixed prefill/decode attention over a paged KV pool on TPU: q [T, Hq, D] -> [T, Hq, D].

    Args:
      q: [num_tokens, num_q_heads, head_dim] float32 / bfloat16, queries of all slots packed by
        ``query_start_loc``; the dots run in bfloat16 unless q or the pools are float32.
      k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim]; block_size a multiple of 8,
        head_dim 64, 128 or 256; float32, bfloat16, or int8 / float8_e4m3fn with scales.
      block_tables: i32[num_slots, max_blocks]; padding entries point at the null block.
      seq_lens: i32[num_slots] context length of each slot, its queries included.
      query_start_loc: i32[num_slots + 1] nondecreasing; rows from ``query_start_loc[-1]`` on are padding
        (zeros out).
      scale, window, softcap: as in ``ragged_paged_attention_reference``.
      interpret: run in Pallas TPU interpret mode (CPU), with its DMA and race checks.
      k_scale, v_scale: f32[num_blocks, block_size, num_kv_heads] for quantized pools, else None.
      **tuning: ``block_q`` (query rows a program, a multiple of 8) and ``blocks_per_iter`` (blocks a
        chunk); defaults from ``tpu_defaults``.
    """
    _validate(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    check_options(window, softcap)
    knobs = with_tuning(tpu_defaults(q.shape[0], block_tables.shape[0], k_pool.shape[1]), tuning)
    if not isinstance(knobs["block_q"], int) or knobs["block_q"] < 8 or knobs["block_q"] % 8:
        raise ValueError(f"block_q must be a positive multiple of 8, got {knobs['block_q']!r}")
    if not isinstance(knobs["blocks_per_iter"], int) or knobs["blocks_per_iter"] < 1:
        raise ValueError(f"blocks_per_iter must be a positive int, got {knobs['blocks_per_iter']!r}")
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _mosaic_tpu_ragged(q, k_pool, v_pool, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
                              query_start_loc.astype(jnp.int32), k_scale, v_scale, scale=scale, window=window,
                              softcap=None if softcap is None else float(softcap), interpret=bool(interpret),
                              **knobs)


__all__ = ["mosaic_tpu_ragged_paged_attention", "tpu_defaults"]
