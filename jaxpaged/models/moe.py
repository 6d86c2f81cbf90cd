"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): a top-k router and grouped matmuls.

Every token's k chosen experts make T*k (token, expert) assignments; sorted by expert they form E
contiguous groups, and `jax.lax.ragged_dot` multiplies each group by its own expert's weights. Shapes
stay fixed (T*k rows), so one compilation serves every routing.
Note: on CPU, XLA lowers `ragged_dot` to a masked dense product over all experts; GPU and TPU lower it
to grouped GEMMs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.config import ModelConfig
from jaxpaged.models.layers import glu
from jaxpaged.models.quant import ragged_dot


def route(h, router, cfg: ModelConfig):
    """h [T, D], router [D, E] -> (weights [T, k] in h's dtype, expert ids i32[T, k]).

    Softmax over all experts in float32, top-k, renormalized over the k when the family does
    (Mixtral always, Qwen3-MoE and OLMoE when norm_topk_prob)."""
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)  # [T, E]
    w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(h.dtype), ids.astype(jnp.int32)


def moe_mlp(h, p, cfg: ModelConfig, act):
    """h [T, D]; p: router [D, E], w_gate, w_up [E, D, F], w_down [E, F, D] -> ([T, D], the chosen expert
    ids i32[T, k], which routing replay returns: SamplingParams.return_routed_experts)."""
    T, D = h.shape
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    w, ids = route(h, p["router"], cfg)
    flat = ids.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k  # [T*k] the token of each sorted assignment
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E] rows per expert
    x = h[token]  # [T*k, D]
    expert = flat[order]  # [T*k] the expert of each sorted assignment (picks quantized weights' scales)
    gate = ragged_dot(x, p["w_gate"], sizes, expert)  # [T*k, F]
    up = ragged_dot(x, p["w_up"], sizes, expert)
    y = ragged_dot(glu(act, gate, up, h.dtype), p["w_down"], sizes, expert)  # [T*k, D]
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, D), y.dtype).at[token].add(y), ids
