"""Reading a Hugging Face config.json, family by family: `model_config_fields` turns it into ModelConfig's
keyword arguments (windows and layer kinds, RoPE variants, MoE routing), with a ValueError naming the field
for what is not supported. Imports nothing of jaxpaged: jaxpaged/config.py builds ModelConfig from it."""
from __future__ import annotations

import json
import math
import os
from typing import Any

GEMMA = ("gemma2", "gemma3")
MOE = ("mixtral", "qwen3_moe", "olmoe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"

# HF `architectures[0]` -> family; the families differ only in the flags ModelConfig carries.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}


def read_config_json(path: str) -> tuple[dict[str, Any], str]:
    """The parsed config.json of model directory `path`, and that file's path (for error messages)."""
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ValueError(f"{path}: not a model directory (no config.json)")
    try:
        with open(f) as fh:
            return json.load(fh), f
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: cannot read config: {e}") from None


def published_dtype(d: dict[str, Any]) -> str | None:
    """The checkpoint's dtype as its config.json records it ("bfloat16", ...; None when it says nothing)."""
    published = d.get("torch_dtype") or d.get("dtype")  # transformers 5 writes "dtype"
    return str(published).removeprefix("torch.") if published else None


def model_config_fields(d: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """ModelConfig's keyword arguments from a HF config dict; `source` names it in errors."""
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        kw = dict(
            family=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family in GEMMA)),
        )
        if family in MOE:
            kw.update(moe_fields(d, family, source))
    except KeyError as e:
        raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
    kw.update(block_fields(d, family, source))
    try:
        kw.update(rope_fields(d, family, kw, source))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: rope_scaling / rope_parameters lacks or mistypes a field "
                         f"({type(e).__name__}: {e})") from None
    kw.update(window_fields(d, family, kw["num_layers"], source))
    if family in GEMMA:
        kw.update(gemma_fields(d, family, source))
    eos = d.get("eos_token_id")
    kw["eos_token_ids"] = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    kw["bos_token_id"] = d.get("bos_token_id")
    kw["torch_dtype"] = published_dtype(d)
    if kw["num_heads"] % kw["num_kv_heads"]:
        raise ValueError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
    return kw


def block_fields(d, family, source):
    """The decoder block's variant: MLP activation, q/k/v bias, q/k norm (and what no family supports)."""
    act_field = "hidden_activation" if family in GEMMA else "hidden_act"
    act = d.get(act_field) or ("gelu_pytorch_tanh" if family in GEMMA else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{source}: {act_field} {act!r} is not supported (only {', '.join(ACTIVATIONS)})")
    out = {"hidden_act": act}
    if family == "qwen2":
        out["attention_bias"] = True
    elif family in ("llama", "mistral", "qwen3", "phi3", "mixtral", "qwen3_moe", "olmoe") + GEMMA:
        out["attention_bias"] = bool(d.get("attention_bias", False))
    out["qk_norm"] = {"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmoe": "flat"}.get(family)
    if family == "olmoe" and d.get("clip_qkv") is not None:
        raise ValueError(f"{source}: clip_qkv {d['clip_qkv']!r} is not supported (only null)")
    if family == "phi3" and float(rope_param(d, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {rope_param(d, 'partial_rotary_factor', 1.0)!r}"
                         " is not supported (only 1.0)")
    return out


def gemma_fields(d, family, source):
    """Gemma's (1 + w) norms, sandwich norms, scaled embeddings, query scale and soft-caps."""
    return dict(norm_plus_one=True, sandwich_norms=True, embed_scale=True,
                query_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
                # absent: the HF config classes' defaults (Gemma 2: 50 and 30; Gemma 3: none)
                attn_softcap=positive_or_none(d, "attn_logit_softcapping", source,
                                              50.0 if family == "gemma2" else None),
                final_softcap=positive_or_none(d, "final_logit_softcapping", source,
                                               30.0 if family == "gemma2" else None))


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
