"""The batched LoRA product inside the step: every token through its own adapter slot, in one pass.

Per target leaf, the slot arrays are a [NS, in, R] and b [NS, R, out] (NS = max_loras + 1 slots, slot 0
all zeros = no adapter, scaling folded into b); each token t carries its slot index idx[t]. Two ways:
- one-hot (`onehot_delta`, used by the step): x @ a of every slot as one [in, NS*R] product, the
  [T, NS*R] result masked to the token's own slot, then one [NS*R, out] product. Plain matrix products,
  which XLA runs on its fast GEMM path (sglang-jax's choice for TPUs);
- gather (`gather_delta`): each token's own a[idx[t]], b[idx[t]] gathered, [T, in, R] and [T, R, out],
  then batched vector products.
On this CPU the one-hot form is the faster (jaxpaged bench lora `product`, docs/results/lora.json).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxpaged.models.quant import dot, dots


def slot_mask(idx, num_slots: int, rank: int, dtype):
    """idx i32[T] -> [T, NS*R] ones on the R columns of the token's slot (zeros for slot 0 too)."""
    cols = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank  # [NS*R] the slot of each column
    return ((cols[None, :] == idx[:, None]) & (idx[:, None] > 0)).astype(dtype)


def onehot_delta(x, a, b, mask):
    """x [T, in]; a [NS, in, R]; b [NS, R, out]; mask [T, NS*R] (`slot_mask`) -> f32[T, out]."""
    NS, d_in, R = a.shape
    a2 = jnp.transpose(a, (1, 0, 2)).reshape(d_in, NS * R)           # [in, NS*R]
    xa = jnp.dot(x, a2, preferred_element_type=jnp.float32) * mask   # [T, NS*R]
    return jnp.dot(xa.astype(b.dtype), b.reshape(NS * R, -1), preferred_element_type=jnp.float32)


def gather_delta(x, a, b, idx):
    """x [T, in]; a [NS, in, R]; b [NS, R, out]; idx i32[T] -> f32[T, out] (slot 0 is zeros)."""
    xa = jnp.einsum("ti,tir->tr", x, a[idx], preferred_element_type=jnp.float32)  # [T, R]
    return jnp.einsum("tr,tro->to", xa.astype(b.dtype), b[idx], preferred_element_type=jnp.float32)


def lora_linear(mask, row_tile: int = 0, kernel: bool = False):
    """The decoder's projection: `linear(x, p, name, dtype=None)` = x @ p[name] (`quant.dot`, over row
    tiles of `row_tile` rows for batch invariance), plus the LoRA delta of each token's slot when the
    layer's `p["lora"]` has the target (mask: `slot_mask`, or None when LoRA is off; the engine refuses
    LoRA with batch invariance, whose delta is not row-tiled); `kernel`: the CPU matmul kernel (`quant.dot`).
    A tuple of names (a layer's q, k and v) gives the tuple of their projections of x, the products
    together where the kernel can (`quant.dots`), each with its own LoRA delta."""
    def one(x, p, name, y):
        if mask is None or name not in p.get("lora", {}).get("a", {}):
            return y
        delta = onehot_delta(x, p["lora"]["a"][name], p["lora"]["b"][name], mask)
        return (y.astype(jnp.float32) + delta).astype(y.dtype)

    def linear(x, p, name, dtype=None):
        if isinstance(name, tuple):
            ys = dots(x, [p[n] for n in name], dtype, row_tile=row_tile, kernel=kernel)
            return tuple(one(x, p, n, y) for n, y in zip(name, ys))
        return one(x, p, name, dot(x, p[name], dtype, row_tile=row_tile, kernel=kernel))
    return linear


def step_mask(params, batch):
    """The step's [T, NS*R] slot mask, or None when the params carry no LoRA slots."""
    if "lora" not in params:
        return None
    a = next(iter(params["lora"]["a"].values()))  # [L, NS, in, R]
    return slot_mask(batch["lora_index"], a.shape[1], a.shape[3], a.dtype)

