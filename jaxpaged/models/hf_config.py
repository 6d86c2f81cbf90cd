"""Reading a Hugging Face config.json, family by family: the fields ModelConfig derives (windows and
layer kinds, RoPE variants, MoE routing), with a ValueError naming the field for what is not supported."""
from __future__ import annotations

import math

GEMMA = ("gemma2", "gemma3")
MOE = ("mixtral", "qwen3_moe", "olmoe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


def positive_or_none(d, name, source, default=None):
    """d[name] (default when absent) as a positive float, or None when null."""
    v = d.get(name, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{source}: {name} must be a positive number or null, got {v!r}")
    return float(v)


def moe_fields(d, family, source):
    """num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob of an MoE family."""
    n = int(d.get("num_local_experts") or d["num_experts"])
    k = int(d["num_experts_per_tok"])
    if not 0 < k <= n:
        raise ValueError(f"{source}: num_experts_per_tok ({k}) must be in 1..{n} (the number of experts)")
    if family == "qwen3_moe" and (d.get("mlp_only_layers") or int(d.get("decoder_sparse_step", 1)) != 1):
        raise ValueError(f"{source}: mlp_only_layers / decoder_sparse_step (dense layers among the MoE "
                         "layers) are not supported (only every layer sparse)")
    f = int(d["moe_intermediate_size"]) if family == "qwen3_moe" else int(d["intermediate_size"])
    return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=f,
                norm_topk_prob=True if family == "mixtral" else bool(d.get("norm_topk_prob", False)))


def window_fields(d, family, num_layers, source):
    """sliding_window and per-layer layer_types, as HF decides which layers slide; {} when none does."""
    sw, types = d.get("sliding_window"), d.get("layer_types")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention true is not supported (only causal)")
    if family in GEMMA and types is None:  # the configs' defaults: Gemma 2 alternates, Gemma 3 5 : 1
        period = 2 if family == "gemma2" else int(d.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        if not d.get("use_sliding_window", False):
            return {}
        if types is None:  # layers from max_window_layers on slide (Qwen3-MoE: all)
            first = 0 if family == "qwen3_moe" else int(d.get("max_window_layers", num_layers))
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    elif family in ("llama", "olmoe"):
        return {}
    if not sw:
        return {}
    types = tuple(types) if types is not None else (SLIDING,) * num_layers
    if len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"{source}: layer_types must list {SLIDING!r} or {FULL!r} for each of the "
                         f"{num_layers} layers, got {types!r}")
    if SLIDING not in types:
        return {}
    return dict(sliding_window=int(sw), layer_types=types)


def rope_param(d, name, default):
    """A RoPE field from the old top-level keys or the new rope_parameters (per layer type: the full one)."""
    rp = d.get("rope_parameters") or {}
    if FULL in rp:  # per layer type (Gemma 3)
        rp = rp[FULL]
    return d.get(name) or rp.get(name) or default


def rope_fields(d, family, kw, source):
    """rope_theta, rope_scaling and (Gemma 3) the local RoPE base, from old- or new-style configs."""
    rp = d.get("rope_parameters") or {}
    out = {"rope_theta": float(rope_param(d, "rope_theta", 10000.0))}
    if family == "gemma3":
        local = (rp.get(SLIDING) or {}) if FULL in rp else {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope_parameters.{SLIDING}.rope_type {local['rope_type']!r} is not "
                             "supported (only 'default')")
        out["rope_local_theta"] = float(local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0)
        if "rope_theta" not in d and not rp.get(FULL, {}).get("rope_theta"):
            out["rope_theta"] = 1_000_000.0
    rs = d.get("rope_scaling") or (rp.get(FULL) if FULL in rp else rp)
    out["rope_scaling"] = rope_scaling_tuple(rs, family, d, kw, source)
    if out["rope_scaling"] and out["rope_scaling"][0] == "longrope":
        # the short factors are exact up to original_max_position_embeddings; HF switches to the long
        # factors beyond it (recomputing every key), which a KV cache cannot: cap the length there
        orig = int(d.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings"))
        out["max_position_embeddings"] = min(kw["max_position_embeddings"], orig)
    return out


def rope_scaling_tuple(rs, family, d, kw, source):
    """ModelConfig.rope_scaling from a rope_scaling / rope_parameters dict (None: plain RoPE)."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("su", "yarn") and family == "phi3":  # Phi-3's old names of longrope
        kind = "longrope"
    if kind == "default":
        return None
    if kind == "llama3":
        return ("llama3", float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                int(rs["original_max_position_embeddings"]))
    if kind == "linear":
        return ("linear", float(rs["factor"]))
    if kind == "longrope":
        orig = int(d.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings"))
        short = tuple(float(x) for x in rs["short_factor"])
        if len(short) != kw["head_dim"] // 2:
            raise ValueError(f"{source}: rope_scaling short_factor must have head_dim/2 = {kw['head_dim'] // 2}"
                             f" entries, got {len(short)}")
        factor = rs.get("factor") or kw["max_position_embeddings"] / orig
        attn = rs.get("attention_factor") or (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
        return ("longrope", short, float(attn))
    raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported "
                     "(only 'llama3', 'linear', 'longrope')")
