"""The one place that picks an attention implementation for the model.

`reference`: plain JAX over the paged pool (the CPU path, and the oracle of the kernels).
`pallas`: the Pallas kernels — the decode kernel for decode-only steps, the ragged kernel otherwise;
on a machine without a GPU they run in interpret mode (slow; for tests).

With tensor parallelism the chosen function runs per device through `shard_map`: each device attends
its own query heads over its own KV heads (q and the pools split on their head axes, the block tables
and lengths replicated), so the kernels stay single-device code and no K/V crosses devices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpaged.parallel.mesh import MODEL_AXIS, POOL_SPEC, SCALE_SPEC, shard_map
from pallas_kernels.reference import ragged_paged_attention_reference


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def resolve_backend(name: str, head_dim: int, block_size: int) -> str:
    """'auto' -> 'pallas' on GPU when the kernels support the shapes, 'reference' otherwise."""
    fits = _pow2(block_size) and _pow2(head_dim) and 16 <= head_dim <= 256
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" and fits else "reference"
    if name not in ("reference", "pallas"):
        raise ValueError(f"attention_backend must be 'auto', 'reference' or 'pallas', got {name!r}")
    if name == "pallas" and not fits:
        raise ValueError(f"attention_backend='pallas' needs a power-of-two block_size and head_dim in "
                         f"16..256 (got block_size {block_size}, head_dim {head_dim})")
    return name


def make_attention(backend: str, decode_only: bool, mesh=None):
    """attn(q [T,Hq,hd], k_pool, v_pool, block_tables [S,B], seq_lens [S], query_start_loc [S+1], **options);
    options (keyword-only, static): scale, window, softcap — forwarded to the implementation as given;
    and for quantized pools the arrays k_scale, v_scale f32[num_blocks, bs, Hkv] (split like the pools).

    With a `mesh` whose "model" axis has more than one device, the function runs per head shard."""
    attn = _single_device(backend, decode_only)
    if mesh is None or mesh.shape[MODEL_AXIS] == 1:
        return attn
    heads = P(None, MODEL_AXIS, None)  # q, out [T, Hq, hd]

    def sharded(q, k_pool, v_pool, *rest, k_scale=None, v_scale=None, **options):
        # rest (tables, lengths, ...) replicated; scale pools (if any) split by KV head like the pools
        scales = () if k_scale is None else (k_scale, v_scale)

        def local(q, k_pool, v_pool, *args):
            n = len(args) - len(scales)
            kw = dict(zip(("k_scale", "v_scale"), args[n:]))
            return attn(q, k_pool, v_pool, *args[:n], **kw, **options)
        f = shard_map(local, mesh, in_specs=(heads, POOL_SPEC, POOL_SPEC) + (P(),) * len(rest)
                      + (SCALE_SPEC,) * len(scales), out_specs=heads)
        return f(q, k_pool, v_pool, *rest, *scales)
    return sharded


def _single_device(backend: str, decode_only: bool):
    if backend == "reference":
        return ragged_paged_attention_reference
    interpret = jax.default_backend() != "gpu"
    from pallas_kernels import paged_attention, ragged_paged_attention
    if not decode_only:
        return functools.partial(ragged_paged_attention, interpret=interpret)

    def decode(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, **options):
        # decode-only: slot i's single query is row query_start_loc[i] (empty slots: seq_lens 0)
        S, T = seq_lens.shape[0], q.shape[0]
        rows = jnp.minimum(query_start_loc[:S], T - 1)
        out = paged_attention(q[rows], k_pool, v_pool, block_tables, seq_lens, interpret=interpret, **options)
        slot_of_row = jnp.searchsorted(query_start_loc[1:], jnp.arange(T), side="right")
        valid = jnp.arange(T) < query_start_loc[S]
        return jnp.where(valid[:, None, None], out[jnp.minimum(slot_of_row, S - 1)], 0).astype(q.dtype)
    return decode
