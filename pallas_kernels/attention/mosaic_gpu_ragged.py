"""Ragged paged attention on Mosaic GPU (Hopper, sm_90a): prefill chunks and decodes packed by
``query_start_loc``, keys through the block table, causal within each slot.

Same public signature and options as the Triton kernel (``triton_ragged.py``), same pool layout
and the same tiles (``tile_layout``: ``block_q`` tokens of one slot each). A program (one warpgroup)
handles one (tile, KV head): its 64 query rows are ``block_q`` tokens x the GQA group (padded to a power
of two), the WGMMA M dimension. K/V blocks come by TMA into a ``num_stages``-deep shared-memory ring,
QK and PV run on WGMMA, the softmax is online in registers. Each program writes its whole tile to its own
row of a tile-major output; plain JAX gathers the tokens' rows back (a tile's rows past its slot's queries
belong to no one, so no program writes another's rows).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.api import (
    check_options,
    check_pow2,
    check_query_start_loc,
    pow2_ceil,
    validate,
    with_tuning,
)
from pallas_kernels.attention.mosaic_gpu_common import (
    ROWS,
    Ring,
    attend,
    check_mosaic,
    fetch,
    gather_scales,
    init_carry,
    interpret_params,
    iota,
    kernel_with_scratch,
    ready,
    ring_scratch,
    smem,
)
from pallas_kernels.attention.triton_decode import compute_dtype, pad_table
from pallas_kernels.attention.triton_ragged import tile_layout


def _ragged_kernel(tiles_ref, tables_ref, q_ref, k_ref, v_ref, *refs, scale, nb, stages, group, window, softcap,
                   quantized, hint):
    # tiles_ref i32[4, P] per tile: slot, first row, valid rows (0 = idle), position of the first row
    # tables_ref i32[S, B] (B a multiple of nb); q_ref [Hkv, (T + block_q) * Gp, D] (row t * Gp + g: token
    # t, head g); k_ref, v_ref [N, bs, Hkv, D]; refs: (ks_ref, vs_ref f32[S, Hkv, B * bs] when quantized),
    # o_ref [P, Hkv, 64, D], then the scratch dict: q_smem, p_smem, o_smem, q_bar and the ring's
    *refs, scratch = refs
    scales, (o_ref,) = (refs[:2], refs[2:]) if quantized else ((None, None), refs)
    ring = Ring(k_ref, v_ref, tables_ref, nb=nb, **{k: scratch[k] for k in Ring._fields if k in scratch},
                ks_ref=scales[0], vs_ref=scales[1])
    p, h = lax.axis_index("p"), lax.axis_index("h")
    D = k_ref.shape[3]
    kb = nb * k_ref.shape[1]
    slot, row0, n_rows, pos0 = tiles_ref[0, p], tiles_ref[1, p], tiles_ref[2, p], tiles_ref[3, p]
    kv_len = jnp.where(n_rows > 0, pos0 + n_rows, 0)  # keys visible to the tile's last row
    n_iter = jnp.minimum(pl.cdiv(kv_len, kb), tables_ref.shape[1] // nb)
    lowest = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)  # first key of the first row's window
    start = jnp.minimum(lax.div(lowest, jnp.int32(kb)), n_iter)  # steps wholly before the window are skipped
    q_smem, q_bar = scratch["q_smem"], scratch["q_bar"]
    plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(row0 * group, ROWS)], q_smem, q_bar.at[0])
    for i in range(stages):  # fill the ring
        pl.when(start + i < n_iter)(functools.partial(fetch, ring, slot, start + i, h, i))
    plgpu.barrier_wait(q_bar.at[0])
    q_pos = lax.div(iota((ROWS, kb), 0, hint), jnp.int32(group)) + pos0  # [64, kb] each row's position

    def body(i, carry):
        stage = lax.rem(i - start, stages)
        k_tile, v_tile, ks, vs = ready(ring, stage, i * kb, kv_len, hint)
        k_pos = iota((ROWS, kb), 1, hint) + i * kb  # [64, kb]
        visible = (k_pos <= q_pos) & (k_pos < kv_len)
        if window is not None:
            visible &= k_pos > q_pos - window
        carry = attend(q_smem, k_tile, v_tile, scratch["p_smem"], carry, visible, ks, vs, scale=scale,
                       softcap=softcap)
        pl.when(i + stages < n_iter)(lambda: fetch(ring, slot, i + stages, h, stage))  # the stage is free again
        return carry

    _, l, acc = lax.fori_loop(start, n_iter, body, init_carry(D, hint))
    o_smem = scratch["o_smem"]
    o_smem[...] = (acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[p, h])
    plgpu.wait_smem_to_gmem(0)


def mosaic_ragged_defaults(num_q_heads, num_kv_heads, head_dim, block_size, max_blocks):
    """Tuning defaults: 64 query rows (block_q tokens x the padded group), 64 keys per step; 3 stages at
    head_dim <= 64, else 2 (two programs an SM fit in shared memory at head_dim 128); max_blocks does not
    matter (the key loop stops at each tile's last position)."""
    Gp = pow2_ceil(num_q_heads // num_kv_heads)
    nb = max(ROWS // block_size, 1)
    return dict(block_q=max(ROWS // Gp, 1), blocks_per_iter=nb, num_stages=3 if head_dim <= 64 else 2)


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "softcap", "interpret", "block_q", "blocks_per_iter", "num_stages"))
def _mosaic_ragged(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, k_scale, v_scale, *, scale,
                   window, softcap, interpret, block_q, blocks_per_iter, num_stages):
    T, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    Gp = ROWS // block_q
    qg = jnp.pad(q.astype(compute_dtype(q, k_pool)).reshape(T, Hkv, G, D), ((0, block_q), (0, 0), (0, Gp - G), (0, 0)))
    qg = jnp.swapaxes(qg, 0, 1).reshape(Hkv, (T + block_q) * Gp, D)  # row t * Gp + g
    tiles = tile_layout(query_start_loc, seq_lens, T, block_q)  # [4, P]
    P = tiles.shape[1]
    tables = pad_table(block_tables, blocks_per_iter)
    kb = blocks_per_iter * k_pool.shape[1]
    scratch = dict(q_smem=smem((ROWS, D), qg.dtype), p_smem=smem((ROWS, kb), qg.dtype),
                   o_smem=smem((ROWS, D), q.dtype), q_bar=plgpu.Barrier(num_barriers=1),
                   **ring_scratch(num_stages, kb, D, k_pool.dtype, qg.dtype, blocks_per_iter))
    scales = () if k_scale is None else (gather_scales(k_scale, tables), gather_scales(v_scale, tables))
    kernel = functools.partial(kernel_with_scratch, _ragged_kernel, tuple(scratch), scale=scale, nb=blocks_per_iter,
                               stages=num_stages, group=Gp, window=window, softcap=softcap,
                               quantized=k_scale is not None, hint=not interpret)
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((P, Hkv, ROWS, D), q.dtype), scratch_types=scratch,
        grid=(P, Hkv), grid_names=("p", "h"), compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None, kernel_name="mosaic_ragged_paged_attention",
    )(tiles, tables, qg, k_pool, v_pool, *scales)  # [P, Hkv, 64, D]
    # token t's rows: tile tile_of[t], local rows (t - first row) * Gp + g
    slot_rows = tiles[1][:, None] + jnp.arange(block_q)  # [P, block_q]
    mine = jnp.arange(block_q) < tiles[2][:, None]
    tile_of = jnp.zeros((T,), jnp.int32).at[jnp.where(mine, slot_rows, T)].set(
        jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[:, None], (P, block_q)), mode="drop")  # [T]
    local = jnp.arange(T) - tiles[1][tile_of]  # [T]
    rows = out.reshape(P, Hkv, block_q, Gp, D)[tile_of, :, local]  # [T, Hkv, Gp, D]
    valid = jnp.arange(T) < query_start_loc[-1]
    out = jnp.where(valid[:, None, None, None], rows[:, :, :G], 0)
    return out.reshape(T, Hq, D).astype(q.dtype)


def mosaic_ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale=None,
                                  window=None, softcap=None, interpret=False, k_scale=None, v_scale=None, **tuning):
    """Mixed prefill/decode attention over a paged KV pool on Mosaic GPU: q [T, Hq, D] -> [T, Hq, D].

    Arguments as ``ragged_paged_attention`` (the Triton kernel), with these limits: q bfloat16 / float16,
    pools the same dtype or int8 / float8_e4m3fn; block_size >= 8; GQA group <= 64. ``interpret=True``
    runs Mosaic GPU's interpret mode (CPU). **tuning: ``block_q`` (tokens per program, a power of two,
    block_q x the padded group = 64 rows), ``blocks_per_iter`` (power of two), ``num_stages``; defaults
    from ``mosaic_ragged_defaults``.
    """
    block_tables, seq_lens = validate(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale)
    check_options(window, softcap)
    check_query_start_loc(query_start_loc, block_tables.shape[0])
    Hq, Hkv = q.shape[1], k_pool.shape[2]
    if Hq // Hkv > ROWS:
        raise ValueError(f"the Mosaic GPU ragged kernel takes GQA groups up to {ROWS} query heads per KV head, "
                         f"got {Hq // Hkv}")
    knobs = with_tuning(mosaic_ragged_defaults(Hq, Hkv, q.shape[2], k_pool.shape[1], block_tables.shape[1]),
                        tuning)
    if knobs["block_q"] * pow2_ceil(Hq // Hkv) != ROWS:
        raise ValueError(f"block_q x the GQA group padded to a power of two must be {ROWS} rows, got block_q "
                         f"{knobs['block_q']} x {pow2_ceil(Hq // Hkv)}")
    check_pow2("blocks_per_iter", knobs["blocks_per_iter"], pl.cdiv(16, k_pool.shape[1]))
    check_mosaic(q, k_pool, k_pool.shape[1], knobs["blocks_per_iter"], knobs["num_stages"])
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _mosaic_ragged(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc.astype(jnp.int32), k_scale,
                          v_scale, scale=scale, window=window, softcap=None if softcap is None else float(softcap),
                          interpret=bool(interpret), **knobs)


__all__ = ["mosaic_ragged_paged_attention", "mosaic_ragged_defaults"]
