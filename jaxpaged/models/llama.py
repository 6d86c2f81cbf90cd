"""The decoder of every supported family (Llama, Mistral, Qwen2, Qwen3) as one pure function.

The families differ only in flags of ModelConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3),
llama3 RoPE scaling, tied embeddings. Layers are stacked on a leading axis and run under `lax.scan`,
so compile time does not grow with depth.

Parameter pytree (arrays in the engine dtype; L = num_layers, D = hidden, F = intermediate,
Hq/Hkv = heads, hd = head_dim, V = vocab):
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
    layers: attn_norm [L, D]; wq [L, D, Hq*hd]; wk, wv [L, D, Hkv*hd]; wo [L, Hq*hd, D]
            bq [L, Hq*hd], bk, bv [L, Hkv*hd] (attention_bias); q_norm, k_norm [L, hd] (qk_norm)
            mlp_norm [L, D]; w_gate, w_up [L, D, F]; w_down [L, F, D]
Matrices are stored [in, out], so tensor parallelism splits the head / F axes (see partition specs in
`jaxpaged/mesh.py`) without the layers knowing.

KV pool: k_pool, v_pool [L * N, block_size, Hkv, hd] — every layer's N blocks in one array; layer l
owns blocks l*N .. l*N+N-1, so block tables and slot mappings are offset by l*N per layer and the
attention functions see an ordinary pool.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[hd/2] inverse frequencies, llama3 scaling applied when configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if cfg.rope_scaling is not None:
        factor, low, high, orig = cfg.rope_scaling
        low_wl, high_wl = orig / low, orig / high
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / factor, inv)
        smooth = (orig / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = np.where(is_mid, mid, scaled)
    return inv.astype(np.float32)


def apply_rope(x, cos, sin):
    """x [T, H, hd]; cos, sin [T, hd/2]; rotate-half convention (HF)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].astype(jnp.float32), x[..., h:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# attn_fn(q [T,Hq,hd], k_pool, v_pool, block_tables [S,B], seq_lens [S], query_start_loc [S+1]) -> [T,Hq,hd]
AttnFn = Callable[..., jax.Array]


def forward(params, cfg: ModelConfig, k_pool, v_pool, batch, attn_fn: AttnFn):
    """One step of the decoder over packed tokens.

    batch: input_ids i32[T], positions i32[T], slot_mapping i32[T] (flat position in one layer's pool),
    block_tables i32[S, B], seq_lens i32[S], query_start_loc i32[S+1], logits_indices i32[S].
    Returns (logits f32[S, V] for each slot's last scheduled token, k_pool, v_pool).
    """
    T = batch["input_ids"].shape[0]
    Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    blocks_per_layer = k_pool.shape[0] // cfg.num_layers
    bs = k_pool.shape[1]
    eps = cfg.rms_norm_eps

    x = params["embed"][batch["input_ids"]]  # [T, D]
    ang = batch["positions"].astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)  # [T, hd/2]

    def layer(carry, xs):
        x, k_pool, v_pool = carry
        p, l = xs
        h = rms_norm(x, p["attn_norm"], eps)
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q, k, v = q.reshape(T, Hq, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if cfg.qk_norm:
            q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # write this step's K/V into the layer's blocks, in place (the pool is the scan carry)
        flat = batch["slot_mapping"] + l * blocks_per_layer * bs  # [T]
        blk, off = flat // bs, flat % bs
        k_pool = k_pool.at[blk, off].set(k.astype(k_pool.dtype))
        v_pool = v_pool.at[blk, off].set(v.astype(v_pool.dtype))
        tables = batch["block_tables"] + l * blocks_per_layer  # [S, B]
        o = attn_fn(q, k_pool, v_pool, tables, batch["seq_lens"], batch["query_start_loc"])  # [T, Hq, hd]
        x = x + o.reshape(T, Hq * hd).astype(x.dtype) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"], eps)
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        return (x, k_pool, v_pool), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, k_pool, v_pool), _ = jax.lax.scan(layer, (x, k_pool, v_pool), (params["layers"], layer_ids))
    x = rms_norm(x[batch["logits_indices"]], params["final_norm"], eps)  # [S, D]
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.dot(x, head, preferred_element_type=jnp.float32)  # [S, V]
    return logits, k_pool, v_pool
