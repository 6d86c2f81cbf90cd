"""Batch-invariant numerics (`EngineConfig.batch_invariant`): a request's tokens and logprobs are the same
bits whatever else is in the step — alone or among others, in any slot, under any bucket or token budget,
beside other requests' prefill chunks — and whatever chunks its own prompt was cut into (so preemption,
recomputation and prefix-cache hits change nothing either).

Every computation of the step is made row-local with a fixed reduction order:
- **Products over tokens.** XLA picks a product's blocking (and so its summation order over the
  contracted axis) from its shapes: on CPU a [64, 576] x [576, 1536] product rounds row 0 differently
  from a [16, 576] one. With `ModelConfig.row_tile` set, `quant.dot` runs every product over tiles of
  ROW_TILE rows (zero-padded), one tile at a time in a loop: the same product on every tile of every step.
  The quantized CPU kernel rounds each row's activations by that row alone (int8 weights' int16 codes in a
  row's outlier blocks included: pallas_kernels/matmul/cpu_quant.py), and its integer dots are exact.
- **Attention.** `invariant_attention` gives every query row its own one-row tile and visits its keys in
  chunks of CHUNK_KEYS positions aligned at position 0, merging them into a running softmax in order, one
  chunk a trip for every row at once (rows past their context see nothing, which leaves their sums
  unchanged to the bit). The reference's work list instead packs (tile, chunk) pairs tile after tile into
  trips whose grouping depends on the other tiles, and groups prefill rows into tiles of 8 with longer
  chunks; the Pallas kernels tile by the step's shape. So this mode uses this function on every backend.
- **Sampler.** Its reductions (log_softmax, sort, cumsum, argmax) are over each row's vocabulary, the same
  whatever the number of rows; each row's draw depends on its own seed (jaxpaged/step/sampler.py).
Not covered: MoE families (the expert products run over the step's tokens sorted by expert), refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import (
    _NEG,
    _chunk_logits,
    _chunk_values,
    _first_block,
    _gather_chunk,
    _rows,
    _scale_rows,
    query_layout,
)

ROW_TILE = 64    # rows a tile: any fixed size does (a row rounds alike anywhere in a tile of one shape,
                 # measured); 64: a decode step of 64 running requests is one trip
CHUNK_KEYS = 32  # keys a trip of attention (whole blocks: rounded up to the block size)


def row_tiled(f, x, tile: int):
    """f over x [M, ...] (or a pytree of such arrays) in tiles of `tile` rows (the last zero-padded), one
    tile a loop trip: f sees the same [tile, ...] shapes whatever M is. Returns f's rows (a pytree of
    [M, ...] arrays) for the M rows."""
    M = jax.tree.leaves(x)[0].shape[0]
    n = -(-M // tile)

    def split(a):  # [M, ...] -> [n, tile, ...]
        return jnp.pad(a, ((0, n * tile - M),) + ((0, 0),) * (a.ndim - 1)).reshape(n, tile, *a.shape[1:])
    y = jax.lax.map(f, jax.tree.map(split, x))  # [n, tile, ...] each
    return jax.tree.map(lambda a: a.reshape(n * tile, *a.shape[2:])[:M], y)


def row_tiled_sample(sample, logits, sp: dict, tile: int):
    """`sample(logits, sp)` (the sampler, its static arguments bound) over tiles of `tile` rows: logits
    f32[R, V] and sp's per-row arrays (leading axis R) split alike, its flags (0-d) shared. Returns the
    sampler's outputs for the R rows."""
    R = logits.shape[0]
    rows = {k: v for k, v in sp.items() if jnp.ndim(v) and v.shape[0] == R}
    flags = {k: v for k, v in sp.items() if k not in rows}
    return row_tiled(lambda t: sample(t[0], {**t[1], **flags}), (logits, rows), tile)


def invariant_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale=None,
                        window=None, softcap=None, k_scale=None, v_scale=None):
    """Ragged paged attention (the reference's signature: q [T, Hq, D] -> [T, Hq, D], causal within each
    request, padding rows zero) whose every row is computed alone, in a fixed order (module docstring):
    rows in tiles of ROW_TILE (XLA CPU's batched products, like its plain ones, round by their shape)."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    max_blocks = block_tables.shape[1]
    cb = max(1, CHUNK_KEYS // bs)  # blocks a chunk
    K = cb * bs
    k_rows, v_rows = _rows(k_pool), _rows(v_pool)
    ks_rows, vs_rows = _scale_rows(k_scale, v_scale)

    def rows(args):  # a tile: q [n, Hq, D], slot [n], pos [n] (-1: padding)
        q, slot, pos = args
        n = q.shape[0]
        qf = q.astype(jnp.float32).reshape(n, Hkv, G, D)  # one-row tiles: R = G rows per KV head
        first = _first_block(pos[:, None], window, bs)  # [n]
        chunks = (jnp.maximum(pos + 1 - first * bs, 0) + K - 1) // K  # [n]

        def body(c, carry):
            m, l, acc = carry  # [n, Hkv, G], [n, Hkv, G], [n, Hkv, G, D]
            col = first[:, None] + c * cb + jnp.arange(cb)  # [n, cb]
            ids = block_tables[slot[:, None], jnp.minimum(col, max_blocks - 1)]  # [n, cb]
            k, ks = _gather_chunk(ids, k_rows, ks_rows, k_pool.dtype, (n, K, Hkv, D))
            v, vs = _gather_chunk(ids, v_rows, vs_rows, v_pool.dtype, (n, K, Hkv, D))
            k_pos = (col[:, :, None] * bs + jnp.arange(bs)).reshape(n, 1, K)
            row_pos = jnp.where(c < chunks, pos, -1)[:, None]  # [n, 1]: past its context a row sees nothing
            s, visible = _chunk_logits(qf, k, ks, k_pos, row_pos, scale, window, softcap, G)  # [n, Hkv, G, K]
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)  # 1 exactly when nothing new is seen
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + _chunk_values(p, v, vs, visible)

        init = (jnp.full((n, Hkv, G), _NEG, jnp.float32), jnp.zeros((n, Hkv, G), jnp.float32),
                jnp.zeros((n, Hkv, G, D), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, jnp.max(chunks), body, init)
        return (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(n, Hq, D)  # padding rows stay 0

    slot, pos = query_layout(query_start_loc, seq_lens, T)  # [T], [T]
    return row_tiled(rows, (q, slot, pos), ROW_TILE).astype(q.dtype)
