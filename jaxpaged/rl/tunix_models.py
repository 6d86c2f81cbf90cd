"""Tunix model families on the engine: for each Tunix model class JaxpagedRollout runs, the Hugging Face
config.json that makes the engine compute what the Tunix model computes, and where each engine parameter
(jaxpaged/models/llama.py's pytree) sits in the Tunix model's state, with the reshape to the engine's layout.

    Llama3 (tunix.models.llama3), Qwen3 (tunix.models.qwen3, dense), Qwen2 (tunix.models.qwen2),
    Gemma3 (tunix.models.gemma3, text)

Each config follows what Tunix 0.1.7's layers compute, which is not always what their ModelConfig says
(see `rope_theta`); Gemma 3's attention options are read from its layers themselves. Tunix is imported only
in jaxpaged/rl/.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Callable

SLIDING, FULL = "sliding_attention", "full_attention"


# -- reshapes: a Tunix weight -> the engine's [in, out] matrix ---------------------------------------------
def _keep(a):
    return a


def _dnh(a):  # [D, N, H] -> [D, N*H]
    return a.reshape(a.shape[0], -1)


def _nhd(a):  # [N, H, D] -> [N*H, D]
    return a.reshape(-1, a.shape[-1])


def _ndh(a):  # [N, D, H] (Gemma's q) -> [D, N*H]
    return a.transpose(1, 0, 2).reshape(a.shape[1], -1)


def _part(i):  # [C, N, D, H] (Gemma's stacked kv / qkv) -> part i as [D, N*H]
    return lambda a: _ndh(a[i])


# engine leaf -> ((path in a Tunix decoder layer, reshape), ...): the first path the state holds is used
Leaves = dict[str, tuple[tuple[tuple[str, ...], Callable], ...]]

LLAMA_LAYER: Leaves = {
    "attn_norm": ((("input_layernorm", "w"), _keep),),
    "mlp_norm": ((("post_attention_layernorm", "w"), _keep),),
    "wq": ((("attn", "q_proj", "w"), _dnh),),
    "wk": ((("attn", "k_proj", "w"), _dnh),),
    "wv": ((("attn", "v_proj", "w"), _dnh),),
    "wo": ((("attn", "o_proj", "w"), _nhd),),
    "w_gate": ((("mlp", "gate_proj", "kernel"), _keep),),  # [D, F]
    "w_up": ((("mlp", "up_proj", "kernel"), _keep),),
    "w_down": ((("mlp", "down_proj", "kernel"), _keep),),  # [F, D]
}
QWEN3_LAYER: Leaves = {**LLAMA_LAYER, "q_norm": ((("attn", "q_norm", "w"), _keep),),  # [hd]
                       "k_norm": ((("attn", "k_norm", "w"), _keep),)}
QWEN2_LAYER: Leaves = {**LLAMA_LAYER, "bq": ((("attn", "q_bias"), _keep),),  # [N*H], added before RoPE
                       "bk": ((("attn", "k_bias"), _keep),), "bv": ((("attn", "v_bias"), _keep),)}
GEMMA3_LAYER: Leaves = {
    # Tunix's norms scale by (1 + scale), as the engine's Gemma norms do: the scales go over unchanged
    "attn_norm": ((("pre_attention_norm", "scale"), _keep),),
    "post_attn_norm": ((("post_attention_norm", "scale"), _keep),),
    "mlp_norm": ((("pre_ffw_norm", "scale"), _keep),),
    "post_mlp_norm": ((("post_ffw_norm", "scale"), _keep),),
    # q_einsum [N, D, H], kv_einsum [2, K, D, H]; with as many KV heads as query heads one qkv_einsum [3, N, D, H]
    "wq": ((("attn", "q_einsum", "w"), _ndh), (("attn", "qkv_einsum", "w"), _part(0))),
    "wk": ((("attn", "kv_einsum", "w"), _part(0)), (("attn", "qkv_einsum", "w"), _part(1))),
    "wv": ((("attn", "kv_einsum", "w"), _part(1)), (("attn", "qkv_einsum", "w"), _part(2))),
    "wo": ((("attn", "attn_vec_einsum", "w"), _nhd),),
    "q_norm": ((("attn", "_query_norm", "scale"), _keep),),
    "k_norm": ((("attn", "_key_norm", "scale"), _keep),),
    "w_gate": ((("mlp", "gate_proj", "kernel"), _keep),),
    "w_up": ((("mlp", "up_proj", "kernel"), _keep),),
    "w_down": ((("mlp", "down_proj", "kernel"), _keep),),
}
LLAMA_TOP = {"embed": ("embedder", "input_embedding"), "final_norm": ("final_norm", "w"), "lm_head": ("lm_head", "w")}
GEMMA3_TOP = {"embed": ("embedder", "input_embedding"), "final_norm": ("final_norm", "scale")}  # tied: no lm_head


@dataclasses.dataclass(frozen=True)
class Family:
    """One Tunix model class on the engine."""
    arch: str  # config.json architectures[0]
    model_type: str
    layer: Leaves
    top: dict[str, tuple[str, ...]]
    config: Callable  # (model) -> the family's config.json fields
    tied: Callable  # (Tunix ModelConfig) -> tied embeddings


def rope_theta(model) -> float:
    """The RoPE base the model's layers compute with: Tunix 0.1.7's Llama 3 and Qwen3 attention call their
    module's `apply_rope` without the config's rope_theta, so its default (1e6) is what the trainer uses."""
    # the class Tunix defined: qwix (LoRA, quantization) wraps a model in a subclass made elsewhere
    module = next(sys.modules[c.__module__] for c in type(model).__mro__
                  if hasattr(sys.modules.get(c.__module__), "apply_rope"))
    return float(inspect.signature(module.apply_rope).parameters["rope_theta"].default)


def _llama_like(model, theta: float) -> dict:
    c = model.config
    return dict(vocab_size=c.vocab_size, hidden_size=c.embed_dim, intermediate_size=c.hidden_dim,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim, rope_theta=theta, rms_norm_eps=c.norm_eps, hidden_act="silu",
                rope_scaling=None)


def _llama_config(model) -> dict:
    return {**_llama_like(model, rope_theta(model)), "attention_bias": False}


def _qwen2_config(model) -> dict:
    # Tunix's Qwen2 builds its RoPE tables from config.rope_theta (unlike its Llama 3 / Qwen3 above), with q/k/v
    # biases (the engine's qwen2 family always has them) and no sliding window
    return {**_llama_like(model, float(model.config.rope_theta)), "use_sliding_window": False}


def _one(values: set, what: str):
    if len(values) != 1:
        raise ValueError(f"JaxpagedRollout: Gemma3 layers of one kind differ in {what} ({sorted(values)}); the "
                         "engine gives each kind one value")
    return values.pop()


def _gemma3_config(model) -> dict:
    """Gemma 3 as Tunix computes it, read from its layers: the attention kind of each layer (Tunix's 5 : 1
    cycle, sliding windows counting the query's own position, as HF's), the RoPE base and linear scale factor
    of each kind (positions divided by the factor: HF's "linear" rope_scaling), the query scale (1/sqrt of
    head_dim or of embed_dim // num_heads), RMSNorm eps 1e-6 (fixed in Tunix), embeddings times sqrt(embed_dim),
    GeGLU with tanh gelu (nnx.gelu's default), tied embeddings, no logit soft-capping (Tunix has none)."""
    c = model.config
    attns = [layer.attn for layer in model.layers]
    local = [a.attn_type.name == "LOCAL_SLIDING" for a in attns]
    kinds = {k: [a for a, s in zip(attns, local) if s == (k == SLIDING)] for k in (SLIDING, FULL)}
    a0 = attns[0]
    scalar = a0.head_dim if a0.query_pre_attn_norm.name == "BY_ONE_OVER_SQRT_HEAD_DIM" \
        else a0.features // a0.num_heads
    out = dict(vocab_size=c.num_embed, hidden_size=c.embed_dim, intermediate_size=c.hidden_dim,
               num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
               head_dim=c.head_dim, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=scalar, attn_logit_softcapping=None, final_logit_softcapping=None,
               layer_types=[SLIDING if s else FULL for s in local], rope_scaling=None)
    if kinds[SLIDING]:
        out["sliding_window"] = int(_one({a.sliding_window_size for a in kinds[SLIDING]}, "sliding_window_size"))
        out["rope_local_base_freq"] = float(_one({a.rope_base_frequency for a in kinds[SLIDING]}, "RoPE base"))
        if float(_one({a.rope_scale_factor for a in kinds[SLIDING]}, "RoPE scale factor")) != 1.0:
            raise ValueError("JaxpagedRollout: Gemma3 sliding layers with a RoPE scale factor other than 1 "
                             "(local_scale_factor) are not supported (the engine scales global layers only)")
    else:  # no sliding layer: the local base is unused
        out["rope_local_base_freq"] = float(c.local_base_frequency)
    if kinds[FULL]:
        out["rope_theta"] = float(_one({a.rope_base_frequency for a in kinds[FULL]}, "RoPE base"))
        factor = float(_one({a.rope_scale_factor for a in kinds[FULL]}, "RoPE scale factor"))
        if factor != 1.0:
            out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    else:
        out["rope_theta"] = float(c.global_base_frequency)
    return out


def _tied(cfg) -> bool:
    return bool(getattr(cfg, "weight_tying", False) or getattr(cfg, "use_tied_embedding", False))


# Tunix model class name -> its family; the key of a config is the module of its class (tunix.models.<key>.model)
FAMILIES = {
    "Llama3": Family("LlamaForCausalLM", "llama", LLAMA_LAYER, LLAMA_TOP, _llama_config, _tied),
    "Qwen3": Family("Qwen3ForCausalLM", "qwen3", QWEN3_LAYER, LLAMA_TOP, _llama_config, _tied),
    "Qwen2": Family("Qwen2ForCausalLM", "qwen2", QWEN2_LAYER, LLAMA_TOP, _qwen2_config, _tied),
    "Gemma3": Family("Gemma3ForCausalLM", "gemma3", GEMMA3_LAYER, GEMMA3_TOP, _gemma3_config, lambda cfg: True),
}
MODULES = {"llama3": "Llama3", "qwen3": "Qwen3", "qwen2": "Qwen2", "gemma3": "Gemma3"}


def _unsupported(name: str, module: str) -> ValueError:
    return ValueError(f"JaxpagedRollout: rollout_actor {name} (module {module}) is not supported; supported: "
                      f"{', '.join(sorted(FAMILIES))} (Tunix's own classes, dense)")


def family_of_model(model) -> Family:
    """The family of a Tunix model (a qwix-wrapped one: of the Tunix class it derives from)."""
    cls = next((c for c in type(model).__mro__ if c.__name__ in FAMILIES
                and c.__module__.startswith("tunix.models.")), None)
    if cls is None or getattr(model.config, "num_experts", None):
        raise _unsupported(type(model).__name__, type(model).__module__)
    return FAMILIES[cls.__name__]


def family_of_config(cfg) -> Family:
    """The family of a Tunix ModelConfig, by the module that defines it (tunix.models.<family>.model)."""
    parts = type(cfg).__module__.split(".")
    key = parts[2] if len(parts) > 2 and parts[:2] == ["tunix", "models"] else None
    if key not in MODULES:
        raise _unsupported(type(cfg).__name__, type(cfg).__module__)
    return FAMILIES[MODULES[key]]


def hf_config(model, eos_id: int, max_model_len: int) -> dict:
    """The Hugging Face config.json the engine reads for a Tunix model."""
    fam = family_of_model(model)
    return dict(architectures=[fam.arch], model_type=fam.model_type, **fam.config(model),
                tie_word_embeddings=fam.tied(model.config), max_position_embeddings=max_model_len,
                eos_token_id=eos_id)
