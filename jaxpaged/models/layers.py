"""Pieces every decoder family shares: RMSNorm (w or 1 + w), RoPE and its scalings, gated MLPs."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.models.quant import dot, dots


def rms_norm(x, w, eps, plus_one: bool = False):
    """RMSNorm over the last axis in float32; scales by w, or by 1 + w (Gemma)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    return (xf * (1.0 + wf if plus_one else wf)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> tuple[np.ndarray, float]:
    """([hd/2] inverse frequencies, factor on cos and sin) of full-attention layers, or of sliding
    layers when `local` and the model gives them their own base (Gemma 3: unscaled)."""
    hd = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = None if local and cfg.rope_local_theta else cfg.rope_scaling
    mscale = 1.0
    if rs is None:
        pass
    elif rs[0] == "llama3":
        factor, low, high, orig = rs[1:]
        low_wl, high_wl = orig / low, orig / high
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / factor, inv)
        smooth = (orig / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = np.where(is_mid, mid, scaled)
    elif rs[0] == "linear":
        inv = inv / rs[1]
    elif rs[0] == "longrope":  # the short factors (lengths up to original_max_position_embeddings)
        inv = inv / np.asarray(rs[1], np.float64)
        mscale = rs[2]
    return inv.astype(np.float32), mscale


def rope_tables(cfg: ModelConfig, positions, local: bool = False):
    """cos, sin [T, hd/2] for positions i32[T]."""
    inv, mscale = rope_inv_freq(cfg, local)
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
    return jnp.cos(ang) * mscale, jnp.sin(ang) * mscale


def apply_rope(x, cos, sin):
    """x [T, H, hd]; cos, sin [T, hd/2]; rotate-half convention (HF)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].astype(jnp.float32), x[..., h:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def activation(name: str):
    """The gate activation of a gated MLP (SwiGLU: silu, GeGLU: gelu_pytorch_tanh)."""
    return {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}[name]


def glu(act, gate, up, dtype):
    """act(gate) * up [.., F] in float32, rounded once to `dtype`. In bfloat16 each elementwise op would
    round (and on CPU be emulated through float32): a mixed 512-token bf16 step on CPU: 564 -> 523 ms."""
    return (act(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


def gated_mlp(h, p, act, linear=None):
    """h [T, D]; p: w_gate, w_up [D, F], w_down [F, D] -> [T, D]. `linear(x, p, name, dtype)`: the
    projection, a tuple of them for a tuple of names (default `quant.dot` / `quant.dots` of p[name]; the
    decoder's adds LoRA, jaxpaged/lora/product.py)."""
    linear = linear or (lambda x, p, name, dtype=None: dots(x, [p[n] for n in name], dtype)
                        if isinstance(name, tuple) else dot(x, p[name], dtype))
    gate, up = linear(h, p, ("w_gate", "w_up"), jnp.float32)  # [T, F] each: one kernel call where it can
    return linear(glu(act, gate, up, h.dtype), p, "w_down")


def softcap(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)
