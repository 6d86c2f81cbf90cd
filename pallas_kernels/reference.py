"""Plain-JAX paged attention: the CPU path of the engine and the oracle of every kernel test.

Pool layout (every kernel shares it): ``k_pool``, ``v_pool``: ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A slot's keys are the first ``seq_lens[i]`` positions of the blocks listed in its row of
``block_tables``; padding entries point at the null block (0), so every gather index is valid.

Keys are visited in chunks of ``chunk_blocks`` blocks inside a ``while`` loop whose trip count is the
longest context in the batch, with an online softmax across chunks: the work is proportional to the
blocks in use, not to the width of the block table, and one compilation serves every context length.

Options shared by every kernel (keyword-only, static): ``scale`` (logit scale, default
``head_dim ** -0.5``), ``window`` (sliding window: a query at position p sees keys p - window < k <= p;
None = unbounded; each query tile starts at the first block its window reaches, so blocks wholly
outside the window are never read) and ``softcap`` (logits become ``softcap * tanh(logits / softcap)``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30
_HIGHEST = jax.lax.Precision.HIGHEST  # an oracle must not drop to TF32 on GPU


def _attend_chunks(q, q_pos, tile_slot, k_pool, v_pool, block_tables, scale, chunk_blocks, window=None,
                   softcap=None, k_scale=None, v_scale=None):
    """Online-softmax attention of query tiles over their slot's paged keys.

    q: [N, Q, Hq, D] — N tiles of Q query rows, all rows of a tile from one slot (tile_slot i32[N]);
    q_pos: i32[N, Q] position of each row, ascending within a tile (keys at positions <= q_pos, and
    > q_pos - window, are visible; -1 sees nothing).
    A tile's keys are gathered once for its Q rows. Returns [N, Q, Hq, D] in float32.
    k_scale, v_scale: f32[num_blocks, bs, Hkv] for quantized pools (else None), gathered beside the
    blocks; the narrow values are widened after the gather, the key scales multiply the logits and the
    value scales the probabilities.
    """
    N, Q, Hq, D = q.shape
    _, bs, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    max_blocks = block_tables.shape[1]
    cb = min(chunk_blocks or max(1, 64 // bs), max_blocks)  # ~64 keys a chunk: best for CPU caches
    tables = block_tables[tile_slot]  # [N, B] each tile's row, gathered once
    qf = (q.astype(jnp.float32) * scale).reshape(N, Q, Hkv, G, D)
    k_rows, v_rows = _rows(k_pool), _rows(v_pool)  # [num_blocks, bs * Hkv * D]
    quantized = k_scale is not None
    if quantized:
        ks_rows, vs_rows = k_scale.reshape(k_scale.shape[0], -1), v_scale.reshape(v_scale.shape[0], -1)
    last = jnp.max(q_pos, axis=1)  # [N] (-1: an empty tile)
    if window is None:
        first_block = jnp.zeros((N,), jnp.int32)
    else:  # the first block the tile's first query's window reaches
        first = jnp.min(jnp.where(q_pos >= 0, q_pos, last[:, None]), axis=1)  # [N]
        first_block = jnp.maximum(first - window + 1, 0) // bs
    n_chunks = jnp.max(jnp.maximum(last + 1 - first_block * bs, 0) + cb * bs - 1) // (cb * bs)

    def body(c, carry):
        m, l, acc = carry  # [N, Hkv, G, Q], [N, Hkv, G, Q], [N, Hkv, G, Q, D]
        col = first_block[:, None] + c * cb + jnp.arange(cb)  # [N, cb] (past the table: clipped, masked)
        ids = jnp.take_along_axis(tables, jnp.minimum(col, max_blocks - 1), axis=1)  # [N, cb]
        # whole blocks as rows of a 2-D view, clipped: XLA's CPU gather is ~2.5x faster this way
        k = _widen(jnp.take(k_rows, ids, axis=0, mode="clip"), k_pool.dtype).reshape(N, cb * bs, Hkv, D)
        v = _widen(jnp.take(v_rows, ids, axis=0, mode="clip"), v_pool.dtype).reshape(N, cb * bs, Hkv, D)
        k_pos = (col[:, :, None] * bs + jnp.arange(bs)).reshape(N, 1, cb * bs)  # [N, 1, K]
        s = jnp.einsum("nqhgd,nkhd->nhgqk", qf, k, precision=_HIGHEST)  # [N, Hkv, G, Q, K]
        if quantized:  # per key and KV head: [N, K, Hkv] -> [N, Hkv, 1, 1, K]
            ks = jnp.take(ks_rows, ids, axis=0, mode="clip").reshape(N, cb * bs, Hkv)
            s = s * ks.transpose(0, 2, 1)[:, :, None, None, :]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        visible = k_pos <= q_pos[:, :, None]  # [N, Q, K]
        if window is not None:
            visible &= k_pos > q_pos[:, :, None] - window
        visible = visible[:, None, None]  # [N, 1, 1, Q, K]
        s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l_new = l * alpha + p.sum(-1)
        if quantized:  # stale scales (even NaN) of invisible keys must not reach the output
            vs = jnp.take(vs_rows, ids, axis=0, mode="clip").reshape(N, cb * bs, Hkv)
            p = jnp.where(visible, p * vs.transpose(0, 2, 1)[:, :, None, None, :], 0.0)
        acc_new = acc * alpha[..., None] + jnp.einsum("nhgqk,nkhd->nhgqd", p, v, precision=_HIGHEST)
        return m_new, l_new, acc_new

    init = (
        jnp.full((N, Hkv, G, Q), _NEG, jnp.float32),
        jnp.zeros((N, Hkv, G, Q), jnp.float32),
        jnp.zeros((N, Hkv, G, Q, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows that saw nothing stay 0
    return out.transpose(0, 3, 1, 2, 4).reshape(N, Q, Hq, D)


def _rows(pool):
    """The pool as rows of whole blocks [num_blocks, bs * Hkv * D]; 8-bit floats as uint8.
    XLA's CPU gather does not take fp8: it widened the whole pool to float32 before the gather, on every
    call. As uint8 it gathers natively, but XLA CPU still copies the pool for the bitcast (~10x slower
    than float32): on CPU, int8 is the fast 8-bit KV cache (docs/benchmarks.md). bfloat16 gathers
    natively once XLA's bf16 float normalization is off, as the engine compiles its CPU steps
    (runner.step_compiler_options); with it on, the pool is widened on every call (slow, still right)."""
    rows = pool.reshape(pool.shape[0], -1)
    if jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize == 1:
        rows = jax.lax.bitcast_convert_type(rows, jnp.uint8)
    return rows


def _widen(rows, dtype):
    """Gathered rows of `_rows` -> float32: the narrow type is read, widened after the gather."""
    if rows.dtype != dtype:
        rows = jax.lax.bitcast_convert_type(rows, dtype)
    return rows.astype(jnp.float32)


def _check_heads(q, k_pool):
    if q.shape[-2] % k_pool.shape[2]:
        raise ValueError(
            f"num_q_heads ({q.shape[-2]}) must be a multiple of num_kv_heads ({k_pool.shape[2]})")


QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


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


def check_options(window, softcap):
    """Validate the shared keyword options; window and softcap must be static Python numbers."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, *, scale=None, window=None,
                              softcap=None, chunk_blocks=None, k_scale=None, v_scale=None):
    """Decode attention, one query per slot: q [S, Hq, D] -> [S, Hq, D].

    The query of slot i sees keys max(0, seq_lens[i] - window)..seq_lens[i]-1; a slot with seq_lens 0
    returns zeros. Quantized pools (int8 / fp8 values) come with k_scale, v_scale f32[num_blocks, bs, Hkv].
    """
    _check_heads(q, k_pool)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    check_options(window, softcap)
    S = q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_pos = seq_lens.astype(jnp.int32)[:, None] - 1  # [S, 1]
    out = _attend_chunks(q[:, None], q_pos, jnp.arange(S, dtype=jnp.int32), k_pool, v_pool,
                         block_tables, scale, chunk_blocks, window, softcap, k_scale, v_scale)
    return out[:, 0].astype(q.dtype)


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


def query_tiles(query_start_loc, seq_lens, num_tokens, tile):
    """Cut each slot's rows into tiles of `tile` rows that never cross a slot boundary.

    Returns (rows i32[N, tile] (num_tokens where a tile runs past its slot), slot i32[N],
    position i32[N, tile] (-1 for rows that are not queries)), N = num_tokens // tile + S (a bound).
    """
    S = seq_lens.shape[0]
    n_rows = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    tile_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum((n_rows + tile - 1) // tile)])
    N = num_tokens // tile + S
    j = jnp.arange(N, dtype=jnp.int32)
    slot = jnp.minimum(jnp.searchsorted(tile_start[1:], j, side="right"), S - 1).astype(jnp.int32)
    rows = query_start_loc[slot][:, None] + (j - tile_start[slot])[:, None] * tile + jnp.arange(tile)
    valid = (rows < query_start_loc[slot + 1][:, None]) & (j < tile_start[S])[:, None]
    pos = seq_lens[slot][:, None] - (query_start_loc[slot + 1][:, None] - rows)
    return jnp.where(valid, rows, num_tokens), slot, jnp.where(valid, pos, -1).astype(jnp.int32)


def ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *,
                                     scale=None, window=None, softcap=None, chunk_blocks=None,
                                     query_tile=None, k_scale=None, v_scale=None):
    """Mixed prefill/decode attention over packed queries: q [T, Hq, D] -> [T, Hq, D].

    Causal within each request; rows past query_start_loc[S] are padding and return zeros.
    Rows are attended in tiles of `query_tile` rows of one slot, each tile gathering its keys once
    (default: 1 when T <= S, i.e. mostly decodes, else 8 — prefill rows then share their gathers).
    Measured on CPU (SmolLM2 heads, a 512-token step of 2 prefill chunks and 62 decodes): 4.2x faster
    per layer than one row per tile with 256-key chunks.
    Quantized pools (int8 / fp8 values) come with k_scale, v_scale f32[num_blocks, bs, Hkv].
    """
    _check_heads(q, k_pool)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    check_options(window, softcap)
    T, S = q.shape[0], seq_lens.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tile = query_tile or (1 if T <= S else 8)
    if tile == 1:
        slot, pos = query_layout(query_start_loc, seq_lens, T)
        out = _attend_chunks(q[:, None], pos[:, None], slot, k_pool, v_pool, block_tables, scale,
                             chunk_blocks, window, softcap, k_scale, v_scale)
        return out[:, 0].astype(q.dtype)
    rows, slot, pos = query_tiles(query_start_loc, seq_lens, T, tile)
    q_tiles = jnp.take(q, rows, axis=0, mode="clip")  # [N, tile, Hq, D]
    out = _attend_chunks(q_tiles, pos, slot, k_pool, v_pool, block_tables, scale, chunk_blocks, window,
                         softcap, k_scale, v_scale)
    out = jnp.zeros(q.shape, jnp.float32).at[rows.reshape(-1)].set(
        out.reshape(-1, *q.shape[1:]), mode="drop")  # rows == T (not queries) are dropped
    return out.astype(q.dtype)
