"""Pieces both Mosaic GPU kernels share: shared-memory buffers, the TMA gather of K/V blocks through the
block table, and one online-softmax step on WGMMA.

A program's tile is 64 query rows (one warpgroup's WGMMA M): the GQA group of one KV head (decode) or
``block_q`` tokens x the group (ragged), padded with zero rows. Keys arrive ``kb = blocks_per_iter *
block_size`` at a time: each block is one TMA copy ``pool[block_id, :, h, :] -> smem[stage, rows]``, all
copies of a step arriving on one barrier, ``num_stages`` steps in flight.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.api import QUANTIZED

ROWS = 64  # query rows per program: the M of one warpgroup's WGMMA
NEG = -1e30
LOG2E = math.log2(math.e)
FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # what WGMMA multiplies here


def smem(shape, dtype):
    """A shared-memory buffer tiled and swizzled for TMA and WGMMA (the widest swizzle its rows allow)."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)),
                                                plgpu.SwizzleTransform(swizzle)))


def check_mosaic(q, k_pool, block_size, blocks_per_iter, num_stages):
    """The Mosaic GPU kernels' own limits (on top of ``validate``): 16-bit q and pools (or int8 / fp8 pools
    under a 16-bit q), block_size >= 8, blocks_per_iter * block_size = 64 keys a step (or a multiple of 64,
    at most 256: the V tile is row-masked in the WGMMA layout, 64 rows a tile)."""
    pools = FLOATS + QUANTIZED
    if jnp.dtype(q.dtype) not in FLOATS or jnp.dtype(k_pool.dtype) not in pools:
        raise ValueError("the Mosaic GPU kernels need q in bfloat16 / float16 and pools in bfloat16 / float16 / "
                         f"int8 / float8_e4m3fn, got q {q.dtype}, pools {k_pool.dtype}; float32 runs on "
                         "attention_backend='triton' or 'reference'")
    if jnp.dtype(k_pool.dtype) in FLOATS and k_pool.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and the pools ({k_pool.dtype}) must have the same dtype")
    if block_size < 8:
        raise ValueError(f"block_size must be >= 8 for the Mosaic GPU kernels (one TMA tile), got {block_size}")
    kb = blocks_per_iter * block_size
    if kb % ROWS or kb > 256:
        raise ValueError(f"blocks_per_iter * block_size must be a multiple of {ROWS} keys, at most 256; got {kb}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")


class Ring(NamedTuple):
    """A slot's K/V on their way in: the pools (GMEM), the shared-memory ring, its barriers.

    k_ref, v_ref [N, bs, Hkv, D]; tables_ref i32[S, B]; k_smem, v_smem [stages, kb, D] (pool dtype);
    k_bar, v_bar: one barrier per stage. Quantized pools add: ks_ref, vs_ref f32[S, Hkv, B * bs] (the
    slots' scales, gathered by the wrapper), ks_smem, vs_smem f32[stages, kb], and k_wide, v_wide [kb, D]
    (16-bit) where the step's tiles are widened for WGMMA.
    """
    k_ref: Any
    v_ref: Any
    tables_ref: Any
    k_smem: Any
    v_smem: Any
    k_bar: Any
    v_bar: Any
    nb: int
    ks_ref: Any = None
    vs_ref: Any = None
    ks_smem: Any = None
    vs_smem: Any = None
    k_wide: Any = None
    v_wide: Any = None


def ring_scratch(stages, kb, head_dim, pool_dtype, dot_dtype, nb):
    """The scratch a Ring needs, in Ring's field order from k_smem on (barriers included)."""
    quantized = jnp.dtype(pool_dtype) in QUANTIZED
    arrivals = nb + 1 if quantized else nb  # one per block copy (+ the step's scale row)
    out = dict(k_smem=smem((stages, kb, head_dim), pool_dtype), v_smem=smem((stages, kb, head_dim), pool_dtype),
               k_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
               v_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages))
    if quantized:
        out.update(ks_smem=plgpu.SMEM((stages, kb), jnp.float32), vs_smem=plgpu.SMEM((stages, kb), jnp.float32),
                   k_wide=smem((kb, head_dim), dot_dtype), v_wide=smem((kb, head_dim), dot_dtype))
    return out


def fetch(ring, slot, step, h, stage):
    """Start the TMA copies of step `step` (``ring.nb`` blocks of slot `slot`, KV head `h`) into `stage`."""
    bs = ring.k_ref.shape[1]
    for b in range(ring.nb):
        block = ring.tables_ref[slot, step * ring.nb + b]
        rows = pl.ds(b * bs, bs)
        plgpu.copy_gmem_to_smem(ring.k_ref.at[block, :, h, :], ring.k_smem.at[stage, rows], ring.k_bar.at[stage])
        plgpu.copy_gmem_to_smem(ring.v_ref.at[block, :, h, :], ring.v_smem.at[stage, rows], ring.v_bar.at[stage])
    if ring.ks_ref is not None:
        keys = pl.ds(step * ring.nb * bs, ring.nb * bs)
        plgpu.copy_gmem_to_smem(ring.ks_ref.at[slot, h, keys], ring.ks_smem.at[stage], ring.k_bar.at[stage])
        plgpu.copy_gmem_to_smem(ring.vs_ref.at[slot, h, keys], ring.vs_smem.at[stage], ring.v_bar.at[stage])


def ready(ring, stage, first_pos, length, hint):
    """Wait for `stage` and make it WGMMA-ready: (k_tile, v_tile, ks, vs). Rows at positions >= length
    are zeroed in v (stale pool contents, even NaN, must not reach p @ v: 0 * NaN is NaN on the tensor
    cores). Quantized: the tiles widened into k_wide / v_wide, ks / vs f32[kb] the keys' scales (vs zero
    past length); float pools: the ring's own tiles, ks = vs = None."""
    plgpu.barrier_wait(ring.k_bar.at[stage])
    plgpu.barrier_wait(ring.v_bar.at[stage])
    k_tile, v_tile = ring.k_smem.at[stage], ring.v_smem.at[stage]
    kb = k_tile.shape[0]
    if ring.ks_ref is None:
        pl.when(first_pos + kb > length)(lambda: _zero_rows(v_tile, v_tile, first_pos, length, hint))
        return k_tile, v_tile, None, None
    ring.k_wide[...] = _widen(in_layout(k_tile[...], plgpu.Layout.WGMMA, hint), ring.k_wide.dtype)
    _zero_rows(v_tile, ring.v_wide, first_pos, length, hint)
    plgpu.commit_smem()
    col = plgpu.Layout.WGMMA.reduce(0)
    ks = in_layout(ring.ks_smem[stage], col, hint)  # [kb]
    vs = in_layout(ring.vs_smem[stage], col, hint)
    pos = in_layout(lax.broadcasted_iota(jnp.int32, (kb,), 0), col, hint) + first_pos
    return ring.k_wide, ring.v_wide, ks, jnp.where(pos < length, vs, 0.0)


def _widen(x, dtype):
    """x cast to `dtype`; fp8 through float16 (exact: e4m3 fits f16), the cast sm_90a converts directly."""
    if x.dtype == jnp.float8_e4m3fn and dtype != jnp.float16:
        x = x.astype(jnp.float16)
    return x.astype(dtype)


def _zero_rows(src, dst, first_pos, length, hint):
    """dst [kb, D] = src with the rows at positions >= length zeroed (cast to dst's dtype)."""
    v = _widen(in_layout(src[...], plgpu.Layout.WGMMA, hint), dst.dtype)  # [kb, D]
    rows = iota(src.shape, 0, hint) + first_pos
    dst[...] = jnp.where(rows < length, v, jnp.zeros_like(v))


def attend(q_smem, k_tile, v_tile, p_smem, carry, visible, ks=None, vs=None, *, scale, softcap):
    """One step of keys into (m, l, acc): s = q k^T on WGMMA, base-2 online softmax, acc += p v on WGMMA.

    q_smem [64, D]; k_tile, v_tile: smem refs [kb, D]; p_smem [64, kb] (16-bit) holds the probabilities
    for the second dot; carry: m, l f32[64] and acc f32[64, D] (WGMMA layouts); visible bool[64, kb];
    ks, vs: f32[kb] dequantization scales of the keys (on the logits) and values (on p), or None.
    """
    m, l, acc = carry
    kb = k_tile.shape[0]

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
        return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, kb), jnp.float32))  # [64, kb]
    if ks is not None:
        s = s * lax.broadcast_in_dim(ks, s.shape, [1])
    if softcap is None:
        s = s * (scale * LOG2E)
    else:
        s = jnp.tanh(s * (scale / softcap)) * (softcap * LOG2E)
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    pw = p if vs is None else p * lax.broadcast_in_dim(vs, p.shape, [1])
    p_smem[...] = pw.astype(p_smem.dtype)
    plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]
    pv = pl.run_scoped(pv, plgpu.ACC((ROWS, acc.shape[1]), jnp.float32))  # [64, D]
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
    return m_new, l * alpha + p.sum(axis=1), acc


def in_layout(x, layout, hint):
    """`x` pinned to a register layout (``plgpu.Layout``) when `hint`; as it is otherwise. The pin is an
    identity on values; Mosaic GPU's interpret mode (JAX 0.10) has no rule for it, so interpreted
    kernels trace without it."""
    return plgpu.layout_cast(x, layout) if hint else x


def init_carry(head_dim, hint):
    """(m, l, acc) at the start: m = NEG, l = 0, acc = 0, in the WGMMA accumulator's layouts."""
    m = in_layout(jnp.full((ROWS,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1), hint)
    l = in_layout(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1), hint)
    acc = in_layout(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, hint)
    return m, l, acc


def iota(shape, dim, hint):
    """i32 iota along `dim`, in the WGMMA accumulator's layout."""
    return in_layout(lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA, hint)


def gather_scales(scale_pool, tables):
    """The slots' per-token scales, laid out for one TMA row per step: f32[N, bs, Hkv] -> [S, Hkv, B * bs].

    Reads S * B * bs * Hkv * 4 bytes per pool (the table's width, not only the blocks in use): the price
    of the [N, bs, Hkv] scale layout, whose per-head rows are strided (TMA needs contiguous rows and
    Mosaic GPU has no strided shared-memory loads)."""
    S, B = tables.shape
    g = scale_pool[tables]  # [S, B, bs, Hkv]
    return jnp.transpose(g, (0, 3, 1, 2)).reshape(S, g.shape[3], B * g.shape[2])


def kernel_with_scratch(kernel, scratch_names, *refs, **kw):
    """Call `kernel(*refs, scratch_dict, **static)`: plgpu.kernel passes a dict of scratch types as
    keyword refs (the `scratch_names`), mixed here with the kernel's static keywords."""
    scratch = {k: kw.pop(k) for k in scratch_names}
    return kernel(*refs, scratch, **kw)


def interpret_params():
    """Mosaic GPU interpret mode (CPU): the parameters object `interpret=` takes."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


__all__ = ["ROWS", "Ring", "ring_scratch", "smem", "check_mosaic", "fetch", "ready", "attend", "in_layout",
           "init_carry", "iota", "interpret_params", "gather_scales"]
