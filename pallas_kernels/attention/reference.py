"""Plain-JAX paged attention: the oracle of every kernel test, and what runs where no kernel can.

Pool layout (every kernel shares it): ``k_pool``, ``v_pool``: ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A slot's keys are the first ``seq_lens[i]`` positions of the blocks listed in its row of
``block_tables``; padding entries point at the null block (0), so every gather index is valid.

Keys are visited in chunks of ``chunk_blocks`` blocks inside a ``while`` loop over a work list of (query
tile, chunk) pairs, each tile only as far as its own context, with softmax sums merged across chunks: the
work is proportional to the blocks in use (the sum of the tiles' contexts), not to the width of the block
table or the longest context, and one compilation serves every context length.

Options shared by every kernel (keyword-only, static): ``scale`` (logit scale, default
``head_dim ** -0.5``), ``window`` (sliding window: a query at position p sees keys p - window < k <= p;
None = unbounded; each query tile starts at the first block its window reaches, so blocks wholly
outside the window are never read) and ``softcap`` (logits become ``softcap * tanh(logits / softcap)``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention.api import check_heads, check_options, check_scales

_NEG = -1e30
_HIGHEST = jax.lax.Precision.HIGHEST  # an oracle must not drop to TF32 on GPU


def _chunk_logits(qf, k, ks, k_pos, q_pos, scale, window, softcap, G):
    """A chunk's masked logits. qf: [N, Hkv, R, D] (R = G x Q query rows, g-major); k: [N, K, Hkv, D]
    float32; ks: [N, K, Hkv] key scales or None; k_pos: [N, 1, K]; q_pos: [N, Q].
    Returns (logits [N, Hkv, R, K], _NEG where not visible; visible bool[N, 1, R, K])."""
    N, Q = q_pos.shape
    K = k.shape[1]
    # dots for every tile size, so that a row rounds alike whatever tile it is in (LLM.score vs the
    # logprobs generate reports, within 2e-5). For one-row tiles a multiply-and-sum, which XLA CPU
    # fuses with the gather, was 1.2x faster, but it rounds differently from the dots (1.3e-5 apart).
    s = jnp.einsum("nhrd,nkhd->nhrk", qf, k, precision=_HIGHEST) * scale  # [N, Hkv, R, K]
    if ks is not None:  # per key and KV head: [N, K, Hkv] -> [N, Hkv, 1, K]
        s = s * ks.transpose(0, 2, 1)[:, :, None, :]
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    visible = k_pos <= q_pos[:, :, None]  # [N, Q, K]
    if window is not None:
        visible &= k_pos > q_pos[:, :, None] - window
    visible = jnp.broadcast_to(visible[:, None, None], (N, 1, G, Q, K)).reshape(N, 1, G * Q, K)
    return jnp.where(visible, s, _NEG), visible


def _chunk_values(p, v, vs, visible):
    """p [N, Hkv, R, K] (probabilities, 0 where not visible) times the chunk's values v [N, K, Hkv, D]
    (float32; vs [N, K, Hkv] value scales or None) -> [N, Hkv, R, D]."""
    if vs is not None:  # stale scales (even NaN) of invisible keys must not reach the output
        p = jnp.where(visible, p * vs.transpose(0, 2, 1)[:, :, None, :], 0.0)
    return jnp.einsum("nhrk,nkhd->nhrd", p, v, precision=_HIGHEST)


def _gather_chunk(ids, rows, scale_rows, dtype, shape):
    """Whole blocks ids [N, cb] of a pool as `_rows` -> float32 [N, K, Hkv, D] (shape), and their scales
    [N, K, Hkv] (None for a pool without). Blocks as rows of a 2-D view, clipped: XLA's CPU gather is
    ~2.5x faster this way."""
    x = _widen(jnp.take(rows, ids, axis=0, mode="clip"), dtype).reshape(shape)
    if scale_rows is None:
        return x, None
    return x, jnp.take(scale_rows, ids, axis=0, mode="clip").reshape(shape[:3])


def _first_block(q_pos, window, bs):
    """The first block each tile's first query's window reaches (0 without a window): q_pos [N, Q]."""
    if window is None:
        return jnp.zeros(q_pos.shape[:1], jnp.int32)
    last = jnp.max(q_pos, axis=1)
    first = jnp.min(jnp.where(q_pos >= 0, q_pos, last[:, None]), axis=1)  # [N]
    return jnp.maximum(first - window + 1, 0) // bs


def _scale_rows(k_scale, v_scale):
    """Scale pools f32[num_blocks, bs, Hkv] as rows of whole blocks (None, None without scales)."""
    if k_scale is None:
        return None, None
    return k_scale.reshape(k_scale.shape[0], -1), v_scale.reshape(v_scale.shape[0], -1)


def _attend_tiles(q, q_pos, tile_slot, k_pool, v_pool, block_tables, scale, chunk_blocks, window=None,
                  softcap=None, k_scale=None, v_scale=None, tiles_per_trip=None):
    """Attention of query tiles over their slot's paged keys, by a work list of (tile, chunk) pairs.

    q: [N, Q, Hq, D] — N tiles of Q query rows, all rows of a tile from one slot (tile_slot i32[N]);
    q_pos: i32[N, Q] position of each row, ascending within a tile (keys at positions <= q_pos, and
    > q_pos - window, are visible; -1 sees nothing). Returns [N, Q, Hq, D] in float32.
    k_scale, v_scale: f32[num_blocks, bs, Hkv] for quantized pools (else None), gathered beside the
    blocks; the narrow values are widened after the gather, the key scales multiply the logits and the
    value scales the probabilities.

    A tile's keys are gathered once for its Q rows, in chunks of cb blocks; each tile has as many chunks
    as its own context needs. The pairs of all tiles, tile after tile, are attended `tiles_per_trip`
    (default N) at a time, so a call costs the sum of its tiles' contexts, not N times the longest (the
    128-request workload's 64-row decode steps: 57 % of the chunks). A pair gives partial softmax sums
    (its max, sum and weighted values), merged into its tile by scatter: a tile's pairs may span trips,
    and the tile's sums are rescaled once a trip, at its first pair.
    """
    N, Q, Hq, D = q.shape
    _, bs, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    W = min(tiles_per_trip or N, N)  # pairs a trip
    max_blocks = block_tables.shape[1]
    # keys a chunk: ~64 for tiles of several rows, ~32 for one row (less of the last chunk wasted)
    cb = min(chunk_blocks or max(1, (32 if Q == 1 else 64) // bs), max_blocks)
    K = cb * bs  # keys a chunk
    # A KV head's G x Q query rows of a tile, g-major, as the rows of one matrix: every tile size runs the
    # same batched dot, scaled after it. (With Q as its own axis, XLA put a one-row tile's keys on the left
    # and its 3 query rows on the right: a product 3 columns wide, 1.33x slower on decode attention.)
    R = G * Q
    qf = q.astype(jnp.float32).reshape(N, Q, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(N, Hkv, R, D)
    k_rows, v_rows = _rows(k_pool), _rows(v_pool)  # [num_blocks, bs * Hkv * D]
    ks_rows, vs_rows = _scale_rows(k_scale, v_scale)
    last = jnp.max(q_pos, axis=1)  # [N] (-1: an empty tile)
    first_block = _first_block(q_pos, window, bs)  # [N]
    chunks = (jnp.maximum(last + 1 - first_block * bs, 0) + K - 1) // K  # [N] each tile's chunks
    ends = jnp.cumsum(chunks)  # [N] one past each tile's last pair
    total = ends[-1]

    def body(i, carry):
        m, l, acc = carry  # each tile's merged sums: [N, Hkv, R], [N, Hkv, R], [N, Hkv, R, D]
        j = i * W + jnp.arange(W)  # this trip's pairs
        tile = jnp.minimum(jnp.searchsorted(ends, j, side="right"), N - 1).astype(jnp.int32)  # [W]
        valid = j < total
        c = j - (ends[tile] - chunks[tile])  # the pair's chunk within its tile
        col = first_block[tile][:, None] + c[:, None] * cb + jnp.arange(cb)  # [W, cb] (past the table: masked)
        ids = block_tables[tile_slot[tile][:, None], jnp.minimum(col, max_blocks - 1)]  # [W, cb]
        k, ks = _gather_chunk(ids, k_rows, ks_rows, k_pool.dtype, (W, K, Hkv, D))
        v, vs = _gather_chunk(ids, v_rows, vs_rows, v_pool.dtype, (W, K, Hkv, D))
        k_pos = (col[:, :, None] * bs + jnp.arange(bs)).reshape(W, 1, K)  # [W, 1, K]
        pos = jnp.where(valid[:, None], q_pos[tile], -1)  # [W, Q]: a pair past the list sees nothing
        s, visible = _chunk_logits(qf[tile], k, ks, k_pos, pos, scale, window, softcap, G)  # [W, Hkv, R, K]
        m_pair = s.max(-1)  # [W, Hkv, R]
        p = jnp.where(visible, jnp.exp(s - m_pair[..., None]), 0.0)
        pv = _chunk_values(p, v, vs, visible)  # [W, Hkv, R, D]
        into = jnp.where(valid, tile, N)  # pairs past the list are dropped
        first = valid & jnp.concatenate([jnp.ones(1, bool), tile[1:] != tile[:-1]])  # a tile's first pair here
        once = jnp.where(first, tile, N)
        m_new = m.at[into].max(m_pair, mode="drop")
        m_tile = m_new[tile]  # [W, Hkv, R] each pair's tile's new max
        alpha = jnp.exp(m[tile] - m_tile)  # the tile's old sums to its new max
        w = jnp.exp(m_pair - m_tile)  # the pair's sums to its tile's new max
        l = l.at[once].multiply(alpha, mode="drop").at[into].add(p.sum(-1) * w, mode="drop")
        acc = acc.at[once].multiply(alpha[..., None], mode="drop").at[into].add(pv * w[..., None], mode="drop")
        return m_new, l, acc

    init = (
        jnp.full((N, Hkv, R), _NEG, jnp.float32),
        jnp.zeros((N, Hkv, R), jnp.float32),
        jnp.zeros((N, Hkv, R, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, (total + W - 1) // W, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # rows that saw nothing stay 0
    return out.reshape(N, Hkv, G, Q, D).transpose(0, 3, 1, 2, 4).reshape(N, Q, Hq, D)


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


def paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, *, scale=None, window=None,
                              softcap=None, chunk_blocks=None, k_scale=None, v_scale=None):
    """Decode attention, one query per slot: q [S, Hq, D] -> [S, Hq, D].

    The query of slot i sees keys max(0, seq_lens[i] - window)..seq_lens[i]-1; a slot with seq_lens 0
    returns zeros. Quantized pools (int8 / fp8 values) come with k_scale, v_scale f32[num_blocks, bs, Hkv].
    """
    check_heads(q, k_pool)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    check_options(window, softcap)
    S = q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_pos = seq_lens.astype(jnp.int32)[:, None] - 1  # [S, 1]
    out = _attend_tiles(q[:, None], q_pos, jnp.arange(S, dtype=jnp.int32), k_pool, v_pool, block_tables,
                        scale, chunk_blocks, window, softcap, k_scale, v_scale)
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


def query_tiles(query_start_loc, seq_lens, num_tokens, tile, include=None):
    """Cut each slot's rows into tiles of `tile` rows that never cross a slot boundary (only the slots
    where `include` bool[S] is true, when given).

    Returns (rows i32[N, tile] (num_tokens where a tile runs past its slot), slot i32[N],
    position i32[N, tile] (-1 for rows that are not queries)), N = num_tokens // tile + S (a bound); the
    tiles in use come first.
    """
    S = seq_lens.shape[0]
    n_rows = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    if include is not None:
        n_rows = jnp.where(include, n_rows, 0)
    tile_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum((n_rows + tile - 1) // tile)])
    N = num_tokens // tile + S
    j = jnp.arange(N, dtype=jnp.int32)
    slot = jnp.minimum(jnp.searchsorted(tile_start[1:], j, side="right"), S - 1).astype(jnp.int32)
    rows = query_start_loc[slot][:, None] + (j - tile_start[slot])[:, None] * tile + jnp.arange(tile)
    valid = (rows < query_start_loc[slot][:, None] + n_rows[slot][:, None]) & (j < tile_start[S])[:, None]
    pos = seq_lens[slot][:, None] - (query_start_loc[slot + 1][:, None] - rows)
    return jnp.where(valid, rows, num_tokens), slot, jnp.where(valid, pos, -1).astype(jnp.int32)


PREFILL_PAIRS = 16  # (tile, chunk) pairs a trip for tiles of several rows


def ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *,
                                     scale=None, window=None, softcap=None, chunk_blocks=None,
                                     query_tile=None, k_scale=None, v_scale=None):
    """Mixed prefill/decode attention over packed queries: q [T, Hq, D] -> [T, Hq, D].

    Causal within each request; rows past query_start_loc[S] are padding and return zeros.
    Rows are attended in tiles of `query_tile` rows of one slot, each tile gathering its keys once
    (default: 1 when T <= S, i.e. mostly decodes, else 8 — prefill rows then share their gathers, and
    slots with a single row still go one row a tile). Measured on CPU (SmolLM2 heads, a 512-token step
    of 2 prefill chunks of 224 and 62 decodes): 18.6 -> 10.9 ms a layer for the split into decodes and
    groups of prefill tiles, which was itself 4.2x faster than one row per tile with 256-key chunks; the
    work list of `_attend_tiles` then took 0.87x of the grouped tiles' time.
    Quantized pools (int8 / fp8 values) come with k_scale, v_scale f32[num_blocks, bs, Hkv].
    """
    check_heads(q, k_pool)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    check_options(window, softcap)
    T, S = q.shape[0], seq_lens.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tile = query_tile or (1 if T <= S else 8)
    attend = functools.partial(_attend_tiles, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                               scale=scale, chunk_blocks=chunk_blocks, window=window, softcap=softcap,
                               k_scale=k_scale, v_scale=v_scale)
    if tile == 1:
        slot, pos = query_layout(query_start_loc, seq_lens, T)
        return attend(q[:, None], pos[:, None], slot)[:, 0].astype(q.dtype)
    # A mixed step: slots with one row (decodes) as one row a tile, S tiles; the others (prefill chunks)
    # in tiles of `tile` rows, PREFILL_PAIRS (tile, chunk) pairs a trip. Each tile attends only as far as its
    # own last key (61 decodes of 32-500 keys and 3 prefill chunks of 150: 0.87x the time of groups of 16
    # tiles each as far as its longest, which was itself 2x faster than one call over all tiles).
    n_rows = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    single = n_rows == 1
    row1 = jnp.minimum(query_start_loc[:S], T - 1)  # each slot's first row
    pos1 = jnp.where(single, seq_lens - 1, -1).astype(jnp.int32)
    out1 = attend(q[row1][:, None], pos1[:, None], jnp.arange(S, dtype=jnp.int32))[:, 0]  # [S, Hq, D]
    out = jnp.zeros(q.shape, jnp.float32).at[jnp.where(single, row1, T)].set(out1, mode="drop")
    rows, slot, pos = query_tiles(query_start_loc, seq_lens, T, tile, include=~single)
    o = attend(jnp.take(q, rows, axis=0, mode="clip"), pos, slot, tiles_per_trip=PREFILL_PAIRS)  # [N, tile, Hq, D]
    out = out.at[rows.reshape(-1)].set(o.reshape(-1, *q.shape[1:]), mode="drop")  # rows == T: dropped
    return out.astype(q.dtype)
