"""Plain-JAX paged attention: the CPU path of the engine and the oracle of every kernel test.

Pool layout (every kernel shares it): ``k_pool``, ``v_pool``: ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A slot's keys are the first ``seq_lens[i]`` positions of the blocks listed in its row of
``block_tables``; padding entries point at the null block (0), so every gather index is valid.

Keys are visited in chunks of ``chunk_blocks`` blocks inside a ``while`` loop whose trip count is the
longest context in the batch, with an online softmax across chunks: the work is proportional to the
blocks in use, not to the width of the block table, and one compilation serves every context length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30
_HIGHEST = jax.lax.Precision.HIGHEST  # an oracle must not drop to TF32 on GPU


def _attend_chunks(q, q_pos, q_slot, k_pool, v_pool, block_tables, scale, chunk_blocks):
    """Online-softmax attention of packed queries over their slot's paged keys.

    q: [T, Hq, D]; q_pos: i32[T] position of each query (keys at positions <= q_pos are visible);
    q_slot: i32[T] slot of each query (rows with q_pos < 0 see nothing).
    Returns [T, Hq, D] in float32.
    """
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    max_blocks = block_tables.shape[1]
    cb = min(chunk_blocks, max_blocks)
    # pad the table so a dynamic slice of cb columns is always in bounds
    pad = (-max_blocks) % cb
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))  # [S, B']
    qf = (q.astype(jnp.float32) * scale).reshape(T, Hkv, G, D)  # [T, Hkv, G, D]
    k_rows = k_pool.reshape(k_pool.shape[0], -1)  # [num_blocks, bs * Hkv * D]
    v_rows = v_pool.reshape(v_pool.shape[0], -1)
    longest = jnp.max(jnp.where(q_pos >= 0, q_pos + 1, 0))
    n_chunks = (longest + cb * bs - 1) // (cb * bs)

    def body(c, carry):
        m, l, acc = carry  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        ids = jax.lax.dynamic_slice_in_dim(tables, c * cb, cb, axis=1)  # [S, cb]
        ids = ids[q_slot]  # [T, cb]
        # whole blocks as rows of a 2-D view, clipped: XLA's CPU gather is ~2.5x faster this way
        k = jnp.take(k_rows, ids, axis=0, mode="clip").reshape(T, cb * bs, Hkv, D).astype(jnp.float32)
        v = jnp.take(v_rows, ids, axis=0, mode="clip").reshape(T, cb * bs, Hkv, D).astype(jnp.float32)
        k_pos = c * cb * bs + jnp.arange(cb * bs)  # [K]
        s = jnp.einsum("thgd,tkhd->thgk", qf, k, precision=_HIGHEST)  # [T, Hkv, G, K]
        visible = k_pos[None, :] <= q_pos[:, None]  # [T, K]
        s = jnp.where(visible[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        p = jnp.where(visible[:, None, None, :], p, 0.0)
        alpha = jnp.exp(m - m_new)
        l_new = l * alpha + p.sum(-1)
        acc_new = acc * alpha[..., None] + jnp.einsum("thgk,tkhd->thgd", p, v, precision=_HIGHEST)
        return m_new, l_new, acc_new

    init = (
        jnp.full((T, Hkv, G), _NEG, jnp.float32),
        jnp.zeros((T, Hkv, G), jnp.float32),
        jnp.zeros((T, Hkv, G, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows that saw nothing stay 0
    return out.reshape(T, Hq, D)


def _check_heads(q, k_pool):
    if q.shape[-2] % k_pool.shape[2]:
        raise ValueError(
            f"num_q_heads ({q.shape[-2]}) must be a multiple of num_kv_heads ({k_pool.shape[2]})")


def paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, *, scale=None, chunk_blocks=16):
    """Decode attention, one query per slot: q [S, Hq, D] -> [S, Hq, D].

    The query of slot i sees keys 0..seq_lens[i]-1; a slot with seq_lens 0 returns zeros.
    """
    _check_heads(q, k_pool)
    S = q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_pos = seq_lens.astype(jnp.int32) - 1  # [S]
    out = _attend_chunks(q, q_pos, jnp.arange(S, dtype=jnp.int32), k_pool, v_pool,
                         block_tables, scale, chunk_blocks)
    return out.astype(q.dtype)


def query_layout(query_start_loc, seq_lens, num_tokens):
    """For packed query rows: (slot i32[T], position i32[T]); padding rows get position -1.

    Slot i's rows query_start_loc[i]:query_start_loc[i+1] are the last tokens of its seq_lens[i] context.
    """
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    S = seq_lens.shape[0]
    slot = jnp.searchsorted(query_start_loc[1:], rows, side="right").astype(jnp.int32)  # [T]
    valid = rows < query_start_loc[S]
    slot = jnp.minimum(slot, S - 1)
    pos = seq_lens[slot] - (query_start_loc[slot + 1] - rows)  # [T]
    return slot, jnp.where(valid, pos, -1).astype(jnp.int32)


def ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *,
                                     scale=None, chunk_blocks=16):
    """Mixed prefill/decode attention over packed queries: q [T, Hq, D] -> [T, Hq, D].

    Causal within each request; rows past query_start_loc[S] are padding and return zeros.
    """
    _check_heads(q, k_pool)
    T = q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    slot, pos = query_layout(query_start_loc, seq_lens, T)
    out = _attend_chunks(q, pos, slot, k_pool, v_pool, block_tables, scale, chunk_blocks)
    return out.astype(q.dtype)
