"""Paged decode attention on Mosaic GPU (Hopper, sm_90a): one query per slot, keys through the block table.

Same public signature and options as the Triton kernel (``triton_decode.py``), same pool layout. A
program (one warpgroup) handles one (slot, 64-row tile of a KV head's query heads, key split): the GQA
group as the WGMMA M dimension (zero rows pad it to 64; groups over 64 take several tiles). K/V blocks
come by TMA, one copy per block, into a ``num_stages``-deep shared-memory ring; QK and PV run on WGMMA
with an online softmax in registers. Quantized pools (int8 / fp8) are widened in shared memory, their
per-token scales folded in, before the dots. Key splits divide each slot's actual context; their
partials are merged in plain JAX like the Triton kernel's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.api import check_options, check_pow2, validate, with_tuning
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

_TARGET_PROGRAMS = 264  # two programs per SM of a 132-SM H100 / H200


def _decode_kernel(lens_ref, tables_ref, q_ref, k_ref, v_ref, *refs, scale, nb, stages, num_splits, tiles,
                   window, softcap, quantized, hint):
    # lens_ref i32[S]; tables_ref i32[S, B] (B a multiple of nb); q_ref [S, Hkv * tiles, 64, D];
    # k_ref, v_ref [N, bs, Hkv, D]; refs: (ks_ref, vs_ref f32[S, Hkv, B * bs] when quantized), o_ref
    # [(J,) S, Hkv * tiles, 64, D], (m_ref, l_ref f32[J, S, Hkv * tiles, 64] when split), then the scratch
    # (keyword): q_smem, p_smem, o_smem, (stat_smem), q_bar and the ring's (ring_scratch)
    *refs, scratch = refs
    split = num_splits > 1
    scales, outs = (refs[:2], refs[2:]) if quantized else ((None, None), refs)
    ring = Ring(k_ref, v_ref, tables_ref, nb=nb, **{k: scratch[k] for k in Ring._fields if k in scratch},
                ks_ref=scales[0], vs_ref=scales[1])
    s, t, j = lax.axis_index("s"), lax.axis_index("t"), lax.axis_index("j")
    h = lax.div(t, jnp.int32(tiles))
    D = k_ref.shape[3]
    kb = nb * k_ref.shape[1]
    length = lens_ref[s]
    n_iter = jnp.minimum(pl.cdiv(length, kb), tables_ref.shape[1] // nb)
    lowest = 0 if window is None else jnp.maximum(length - window, 0)  # first key in the window
    first = lax.div(lowest, jnp.int32(kb))  # steps wholly before the window are skipped
    per_split = pl.cdiv(jnp.maximum(n_iter - first, 0), num_splits)
    start = first + j * per_split
    stop = jnp.minimum(start + per_split, n_iter)
    q_smem, q_bar = scratch["q_smem"], scratch["q_bar"]
    plgpu.copy_gmem_to_smem(q_ref.at[s, t], q_smem, q_bar.at[0])
    for p in range(stages):  # fill the ring
        pl.when(start + p < stop)(functools.partial(fetch, ring, s, start + p, h, p))
    plgpu.barrier_wait(q_bar.at[0])

    def body(i, carry):
        stage = lax.rem(i - start, stages)
        k_tile, v_tile, ks, vs = ready(ring, stage, i * kb, length, hint)
        k_pos = iota((ROWS, kb), 1, hint) + i * kb  # [64, kb]
        visible = (k_pos < length) & (k_pos >= lowest)
        carry = attend(q_smem, k_tile, v_tile, scratch["p_smem"], carry, visible, ks, vs, scale=scale,
                       softcap=softcap)
        pl.when(i + stages < stop)(lambda: fetch(ring, s, i + stages, h, stage))  # the stage is free again
        return carry

    m, l, acc = lax.fori_loop(start, stop, body, init_carry(D, hint))
    out = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])  # empty: zeros
    o_smem = scratch["o_smem"]
    o_smem[...] = out.astype(o_smem.dtype)
    if split:
        scratch["stat_smem"].at[0][...] = m
        scratch["stat_smem"].at[1][...] = l
    plgpu.commit_smem()
    if split:
        o_ref, m_ref, l_ref = outs
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[j, s, t])
        plgpu.copy_smem_to_gmem(scratch["stat_smem"].at[0], m_ref.at[j, s, t])
        plgpu.copy_smem_to_gmem(scratch["stat_smem"].at[1], l_ref.at[j, s, t])
    else:
        plgpu.copy_smem_to_gmem(o_smem, outs[0].at[s, t])
    plgpu.wait_smem_to_gmem(0)


def mosaic_decode_defaults(num_slots, num_kv_heads, head_dim, block_size, max_blocks):
    """Tuning defaults: 64 keys per step; 3 stages at head_dim <= 64, else 2 (two programs an SM fit in
    shared memory at head_dim 128: ~106 KB each); splits to fill ~2 programs an SM."""
    nb = max(ROWS // block_size, 1)
    iters = pl.cdiv(max_blocks, nb)
    splits = max(1, min(_TARGET_PROGRAMS // (num_slots * num_kv_heads), iters, 32))
    return dict(blocks_per_iter=nb, num_splits=splits, num_stages=3 if head_dim <= 64 else 2)


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "softcap", "interpret", "blocks_per_iter", "num_splits", "num_stages"))
def _mosaic_decode(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale, *, scale, window, softcap, interpret,
                   blocks_per_iter, num_splits, num_stages):
    S, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    tiles = pl.cdiv(G, ROWS)
    qg = q.astype(compute_dtype(q, k_pool)).reshape(S, Hkv, G, D)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, tiles * ROWS - G), (0, 0))).reshape(S, Hkv * tiles, ROWS, D)
    tables = pad_table(block_tables, blocks_per_iter)
    kb = blocks_per_iter * k_pool.shape[1]
    split = num_splits > 1
    T = Hkv * tiles
    if split:
        out_type = [jax.ShapeDtypeStruct((num_splits, S, T, ROWS, D), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, S, T, ROWS), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, S, T, ROWS), jnp.float32)]
    else:
        out_type = [jax.ShapeDtypeStruct((S, T, ROWS, D), q.dtype)]
    scratch = dict(q_smem=smem((ROWS, D), q.dtype), p_smem=smem((ROWS, kb), q.dtype),
                   o_smem=smem((ROWS, D), out_type[0].dtype), q_bar=plgpu.Barrier(num_barriers=1),
                   **ring_scratch(num_stages, kb, D, k_pool.dtype, q.dtype, blocks_per_iter))
    if split:
        scratch["stat_smem"] = plgpu.SMEM((2, ROWS), jnp.float32)
    scales = () if k_scale is None else (gather_scales(k_scale, tables), gather_scales(v_scale, tables))
    kernel = functools.partial(kernel_with_scratch, _decode_kernel, tuple(scratch), scale=scale, nb=blocks_per_iter,
                               stages=num_stages, num_splits=num_splits, tiles=tiles, window=window,
                               softcap=softcap, quantized=k_scale is not None, hint=not interpret)
    outs = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(S, T, num_splits), grid_names=("s", "t", "j"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None, kernel_name="mosaic_paged_attention_decode",
    )(seq_lens, tables, qg, k_pool, v_pool, *scales)
    if split:  # merge the key splits: weights l * 2^(m - max m)
        o, m, l = outs  # [J, S, T, 64, D], [J, S, T, 64], [J, S, T, 64]
        w = l * jnp.exp2(m - m.max(axis=0))
        out = (w[..., None] * o).sum(axis=0) / jnp.maximum(w.sum(axis=0), 1e-30)[..., None]
    else:
        out = outs[0]
    out = out.reshape(S, Hkv, tiles * ROWS, D)[:, :, :G]
    return out.reshape(S, Hq, D).astype(q.dtype)


def mosaic_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, *, scale=None, window=None, softcap=None,
                           interpret=False, k_scale=None, v_scale=None, **tuning):
    """Decode attention over a paged KV pool on Mosaic GPU: q [S, Hq, D] -> [S, Hq, D].

    Arguments as ``paged_attention`` (the Triton kernel), with these limits: q bfloat16 / float16, pools
    the same dtype or int8 / float8_e4m3fn; block_size >= 8. ``interpret=True`` runs Mosaic GPU's
    interpret mode (CPU). **tuning: ``blocks_per_iter`` (power of two), ``num_splits`` (key splits per
    slot), ``num_stages`` (steps of K/V in flight); defaults from ``mosaic_decode_defaults``.
    """
    block_tables, seq_lens = validate(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale)
    check_options(window, softcap)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} slots but block_tables has {block_tables.shape[0]} rows")
    knobs = with_tuning(mosaic_decode_defaults(q.shape[0], k_pool.shape[2], q.shape[2], k_pool.shape[1],
                                               block_tables.shape[1]), tuning)
    check_pow2("blocks_per_iter", knobs["blocks_per_iter"], pl.cdiv(16, k_pool.shape[1]))
    if knobs["num_splits"] < 1:
        raise ValueError(f"num_splits must be >= 1, got {knobs['num_splits']}")
    check_mosaic(q, k_pool, k_pool.shape[1], knobs["blocks_per_iter"], knobs["num_stages"])
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    return _mosaic_decode(q, k_pool, v_pool, block_tables, seq_lens, k_scale, v_scale, scale=scale, window=window,
                          softcap=None if softcap is None else float(softcap), interpret=bool(interpret), **knobs)


__all__ = ["mosaic_paged_attention", "mosaic_decode_defaults"]
