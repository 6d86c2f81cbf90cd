"""The decoder of every supported family as one pure function: Llama-shaped blocks with flags.

Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3 and the MoE families (Mixtral, Qwen3-MoE, OLMoE) differ only
in flags of ModelConfig: q/k/v bias (Qwen2), q/k RMSNorm per head (Qwen3, Gemma 3) or over all heads
(OLMoE), RoPE scalings, tied embeddings, sliding windows per layer, and Gemma's (1 + w) norms, extra
norms after attention and MLP, embedding scale, GeGLU, logit scale and soft-capping; the MLP is dense
or a mixture of experts (`moe.py`). Shared pieces live in `layers.py`.

Layers are stacked on a leading axis and run under `lax.scan`. Where layers come in kinds (sliding
or full attention, each with its RoPE), the scan runs over groups of `cfg.layer_period` layers — one
of each position of the pattern, unrolled — and a tail of `L % period` layers follows; so compile time
does not grow with depth and every kind sees static options (window, RoPE tables).

Parameter pytree (arrays in the engine dtype; L = num_layers, D = hidden, F = intermediate,
Hq/Hkv = heads, hd = head_dim, V = vocab, E = experts, Fe = moe_intermediate):
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
    layers: attn_norm [L, D]; wq [L, D, Hq*hd]; wk, wv [L, D, Hkv*hd]; wo [L, Hq*hd, D]
            bq [L, Hq*hd], bk, bv [L, Hkv*hd] (attention_bias)
            q_norm, k_norm [L, hd] (qk_norm "head") or [L, Hq*hd], [L, Hkv*hd] (qk_norm "flat")
            post_attn_norm, post_mlp_norm [L, D] (sandwich_norms)
            mlp_norm [L, D]; dense: w_gate, w_up [L, D, F]; w_down [L, F, D]
                             MoE: router [L, D, E]; w_gate, w_up [L, E, D, Fe]; w_down [L, E, Fe, D]
    lora (optional, LoRA on; jaxpaged/lora/slots.py): a {leaf: [L, NS, in, R]}, b {leaf: [L, NS, R, out]},
            read per token through batch["lora_index"] i32[T] (jaxpaged/lora/product.py)
Matrices (and the embedding) may be `jaxpaged.models.qarray.QArray`s (weight-only int8 / int4 / fp8), or
packed for the quantized CPU kernel (`jaxpaged.models.qpacked.QPacked`); every product goes through `quant.dot`.
Matrices are stored [in, out], so tensor parallelism splits the head / F axes, and expert parallelism
the E axis (see partition specs in `jaxpaged/step/mesh.py`) without the layers knowing.

KV pool: k_pool, v_pool [L * N, block_size, Hkv, hd] — every layer's N blocks in one array; layer l
owns blocks l*N .. l*N+N-1, so block tables and slot mappings are offset by l*N per layer and the
attention functions see an ordinary pool. A quantized pool (`kv_cache.QuantPool`) carries its values and
scales f32[L * N, block_size, Hkv]: K/V are quantized at the write, the scales handed to attention.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpaged.config import SLIDING, ModelConfig
from jaxpaged.lora.product import lora_linear, step_mask
from jaxpaged.models.layers import activation, apply_rope, gated_mlp, rms_norm, rope_tables, softcap
from jaxpaged.models.moe import moe_mlp
from jaxpaged.models.quant import QUANTIZED_LAYER_LEAVES, LayerOf, QArray, QPacked, dot, take_rows
from jaxpaged.step import kv_cache
from jaxpaged.step.batch_invariant import row_tiled

# attn_fn(q [T,Hq,hd], k_pool, v_pool, block_tables [S,B], seq_lens [S], query_start_loc [S+1], *,
#         scale, window, softcap, k_scale=None, v_scale=None) -> [T,Hq,hd]  (scales: quantized pools)
AttnFn = Callable[..., jax.Array]


def forward(params, cfg: ModelConfig, k_pool, v_pool, batch, attn_fn: AttnFn):
    """One step of the decoder over packed tokens.

    batch: input_ids i32[T], positions i32[T], slot_mapping i32[T] (flat position in one layer's pool),
    block_tables i32[S, B], seq_lens i32[S], query_start_loc i32[S+1], logits_indices i32[S].
    Returns (logits f32[S, V] for each slot's last scheduled token, k_pool, v_pool).
    """
    h, k_pool, v_pool = decoder(params, cfg, k_pool, v_pool, batch, attn_fn)
    return lm_logits(params, cfg, h[batch["logits_indices"]]), k_pool, v_pool


def lm_logits(params, cfg: ModelConfig, h):
    """Final hidden states h [..., D] (after the final norm) -> logits f32[..., V]."""
    tied = cfg.tie_word_embeddings  # the head: embed [V, D] transposed, or lm_head [D, V]; maybe QArrays
    logits = dot(h, params["embed"] if tied else params["lm_head"], jnp.float32, transpose=tied,
                 row_tile=cfg.row_tile, kernel=cfg.cpu_matmul)
    return softcap(logits, cfg.final_softcap)


def decoder(params, cfg: ModelConfig, k_pool, v_pool, batch, attn_fn: AttnFn, *, capture=(), steer=(),
            steering=None, routes: bool = False, prompt_embeds=None):
    """The decoder layers and the final norm over packed tokens (batch as in `forward`; logits_indices
    unused). Returns (hidden states [T, D] after the final norm, k_pool, v_pool).

    Research hooks (static layer indices, as transformers' `output_hidden_states` counts; see
    docs/research.md): before layer i runs, `steering[:, steer.index(i)]` ([T, D]) is added to the residual
    stream for each i in `steer` (0 <= i < L; i = 0: the embeddings); with `capture`, the states at each
    index i in it (the residual stream entering layer i, or for i = L the output of the final norm) are
    returned too: (hidden, k_pool, v_pool, states [T, len(capture), D]). Scans run between hooked layers,
    so layers without a hook cost what they cost without hooks.

    `routes` (MoE models): the expert ids each layer's router chose for each token, i32[T, L, k], are
    returned last (after the states); the scan gives them as its per-layer outputs.

    `prompt_embeds` (bool[T], f32[T, D]): the rows marked take the given embeddings in place of the token
    lookup's output (as vLLM reads them: before the embedding scale on Gemma 2, after it on Gemma 3, which
    takes them as given; jaxpaged/step/prompt_embeds.py)."""
    if routes and not cfg.num_experts:
        raise ValueError("routes (return_routed_experts) needs a mixture-of-experts model")
    T = batch["input_ids"].shape[0]
    Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    L, P = cfg.num_layers, cfg.layer_period
    blocks_per_layer, bs = kv_cache.pool_values(k_pool).shape[:2]
    blocks_per_layer //= L
    eps, plus_one = cfg.rms_norm_eps, cfg.norm_plus_one
    act = activation(cfg.hidden_act)
    norm = lambda x, w: rms_norm(x, w, eps, plus_one)
    if cfg.row_tile:  # batch invariance: XLA CPU's row reductions too round by the row count
        norm = lambda x, w: row_tiled(lambda t: rms_norm(t, w, eps, plus_one), x, cfg.row_tile)

    x = take_rows(params["embed"], batch["input_ids"])  # [T, D]
    scale = jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)  # HF rounds sqrt(hidden) to the param dtype first
    if cfg.embed_scale:
        x = x * scale
    if prompt_embeds is not None:
        use, given = prompt_embeds  # bool[T], f32[T, D]
        given = given.astype(x.dtype)
        if cfg.embed_scale and cfg.family == "gemma2":  # vLLM scales Gemma 2's; Gemma 3's are taken as given
            given = given * scale
        x = jnp.where(use[:, None], given, x)
    kinds = sorted(set(cfg.layer_types))
    ropes = {t: rope_tables(cfg, batch["positions"], local=t == SLIDING) for t in kinds}  # cos, sin [T, hd/2]
    # x @ w over the tokens (in row tiles for batch invariance), plus each token's LoRA slot (jaxpaged/lora/)
    linear = lora_linear(step_mask(params, batch), row_tile=cfg.row_tile, kernel=cfg.cpu_matmul)
    layers = params["layers"] if "lora" not in params else {**params["layers"], "lora": params["lora"]}

    def layer(x, k_pool, v_pool, p, l, kind):
        """One decoder layer; l is the (traced) layer index, kind its static layer type."""
        h = norm(x, p["attn_norm"])
        q, k, v = linear(h, p, ("wq", "wk", "wv"))  # one kernel call where it can (quant.dots)
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if cfg.qk_norm == "flat":
            q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
        q, k, v = q.reshape(T, Hq, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if cfg.qk_norm == "head":
            q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
        cos, sin = ropes[kind]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # write this step's K/V into the layer's blocks, in place (the pool is the scan carry)
        flat = batch["slot_mapping"] + l * blocks_per_layer * bs  # [T]
        blk, off = flat // bs, flat % bs
        k_pool, v_pool = kv_cache.write(k_pool, blk, off, k), kv_cache.write(v_pool, blk, off, v)
        tables = batch["block_tables"] + l * blocks_per_layer  # [S, B]
        k_vals, v_vals, scales = kv_cache.attention_args(k_pool, v_pool)
        o = attn_fn(q, k_vals, v_vals, tables, batch["seq_lens"], batch["query_start_loc"],
                    scale=cfg.query_scale, window=cfg.sliding_window if kind == SLIDING else None,
                    softcap=cfg.attn_softcap, **scales)  # [T, Hq, hd]
        o = linear(o.reshape(T, Hq * hd).astype(x.dtype), p, "wo")
        x = x + (norm(o, p["post_attn_norm"]) if cfg.sandwich_norms else o)
        h = norm(x, p["mlp_norm"])
        m, ids = moe_mlp(h, p, cfg, act) if cfg.num_experts else (gated_mlp(h, p, act, linear), None)
        x = x + (norm(m, p["post_mlp_norm"]) if cfg.sandwich_norms else m)
        return x, k_pool, v_pool, ids  # ids i32[T, k]: the router's choice (MoE), else None

    G = L // P
    # the CPU matmul kernels read a layer's plain (or packed quantized) matrices out of the stacks in place
    in_place = {name for name in QUANTIZED_LAYER_LEAVES if P == 1 and name in layers and (
                isinstance(layers[name], QPacked) or cfg.cpu_matmul and not isinstance(layers[name], QArray))
                and layers[name].ndim == 3}
    # P == 1 scans the stacked leaves as they are: a reshape of an entry parameter makes XLA copy every
    # weight into the loop once per step
    grouped = layers if P == 1 else jax.tree.map(lambda a: a[:G * P].reshape(G, P, *a.shape[1:]), layers)
    hooks = sorted(set(capture) | set(steer))
    states = {}

    def hook(x, l):  # static l: the residual stream entering layer l
        if l in steer:
            x = x + steering[:, steer.index(l)].astype(x.dtype)
        if l in capture:
            states[l] = x
        return x

    def group(carry, g):  # P layers of group g, one of each kind position of the pattern, unrolled
        x, k_pool, v_pool = carry
        p = {name: LayerOf(a, g) if name in in_place else
             jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, g, keepdims=False), a)
             for name, a in grouped.items()}
        chosen = []
        for j in range(P):
            if isinstance(g, int):  # a hooked group, unrolled
                x = hook(x, g * P + j)
            pj = p if P == 1 else jax.tree.map(lambda a: a[j], p)
            x, k_pool, v_pool, ids = layer(x, k_pool, v_pool, pj, g * P + j, cfg.layer_types[j])
            chosen.append(ids)
        return (x, k_pool, v_pool), jnp.stack(chosen) if routes else None  # [P, T, k]

    # groups run under lax.scan, split where a hook falls; a group with a hook inside it runs unrolled
    inner = sorted({l // P for l in hooks if l < G * P and l % P})
    cuts = sorted({0, G} | {l // P for l in hooks if l < G * P} | {g + 1 for g in inner})
    carry = (x, k_pool, v_pool)
    routed = []  # with routes: the expert ids of each stretch of layers, [n, T, k], in layer order
    for g0, g1 in zip(cuts, cuts[1:]):
        if g0 in inner:
            carry, ys = group(carry, g0)
            routed.append(ys)
            continue
        carry = (hook(carry[0], g0 * P),) + carry[1:]
        carry, ys = jax.lax.scan(group, carry, jnp.arange(g0, g1, dtype=jnp.int32))
        routed.append(ys if ys is None else ys.reshape(-1, *ys.shape[2:]))  # [(g1-g0)*P, T, k]
    x, k_pool, v_pool = carry
    for l in range(G * P, L):  # the tail of a pattern that does not divide the depth
        pl_ = jax.tree.map(lambda a: a[l], layers)
        x, k_pool, v_pool, ids = layer(hook(x, l), k_pool, v_pool, pl_, l, cfg.layer_types[l])
        routed.append(ids if ids is None else ids[None])
    h = norm(x, params["final_norm"])  # [T, D]
    outs = []
    if capture:
        states[L] = h
        outs.append(jnp.stack([states[i] for i in capture], axis=1))  # [T, nL, D]
    if routes:
        outs.append(jnp.concatenate(routed).transpose(1, 0, 2))  # [T, L, k]
    return (h, k_pool, v_pool, *outs)
