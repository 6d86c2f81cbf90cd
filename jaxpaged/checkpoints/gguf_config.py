"""A GGUF file's metadata -> the Hugging Face config dict of the model it holds.

llama.cpp writes one `general.architecture` per model family, its hyperparameters as `<arch>.<key>`
entries. The dict is built from transformers' `GGUF_CONFIG_MAPPING` where it lists the architecture, from
llama.cpp's common keys (`_COMMON_KEYS`) for the rest, then completed by the HF config class. What llama.cpp
does not store but fixes in its code (Gemma's query scale and local RoPE base, Qwen3-MoE's normalized
top-k) is set here by the same rule. The llama architecture carries Mistral (a sliding window) and Mixtral
(`expert_count`) too: the HF architecture follows from those keys.
"""
from __future__ import annotations

# GGUF `general.architecture` -> HF model_type; for "llama", see `hf_model_type`
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "olmoe": "olmoe"}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                    "olmoe": "OlmoeForCausalLM"}
# llama.cpp's keys every architecture writes the same way (under `<arch>.`) -> HF keys
_COMMON_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                "rope.freq_base": "rope_theta", "attention.sliding_window": "sliding_window",
                "attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping", "vocab_size": "vocab_size"}
# the MoE keys, per HF model type
_MOE_KEYS = {"mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
             "qwen3_moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                           "expert_feed_forward_length": "moe_intermediate_size"},
             "olmoe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}}


def hf_model_type(arch: str, meta: dict) -> str:
    """The HF model type of a file of GGUF architecture `arch` (llama: Mixtral with experts, Mistral with a
    sliding window, else Llama)."""
    if arch == "llama":
        if meta.get("llama.expert_count"):
            return "mixtral"
        return "mistral" if meta.get("llama.attention.sliding_window") else "llama"
    return GGUF_ARCHITECTURES[arch]


def config_dict(path: str, arch: str, meta: dict, tensor_names: set[str]) -> dict:
    """The HF config dict (with `architectures`) of the GGUF file `path`; ValueError naming the file when
    the metadata does not make a config."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    model_type = hf_model_type(arch, meta)
    d = {"model_type": model_type, "architectures": [HF_ARCHITECTURES[model_type]],
         # llama.cpp writes the output projection only when it is not the embedding matrix
         "tie_word_embeddings": "output.weight" not in tensor_names}
    table = {**GGUF_CONFIG_MAPPING.get(arch, GGUF_CONFIG_MAPPING.get(model_type, {}))}
    for key, hf_key in {**_COMMON_KEYS, **_MOE_KEYS.get(model_type, {})}.items():
        table.setdefault(key, hf_key)
    table["attention.key_length"] = "head_dim"  # Qwen3, Gemma: head_dim is not hidden / heads
    for key, hf_key in table.items():
        if hf_key is not None and f"{arch}.{key}" in meta:
            d[hf_key] = meta[f"{arch}.{key}"]
    for key, hf_key in GGUF_CONFIG_MAPPING["tokenizer"].items():
        if hf_key is not None and f"tokenizer.{key}" in meta:
            d[hf_key] = meta[f"tokenizer.{key}"]
    if "vocab_size" not in d and "tokenizer.ggml.tokens" in meta:
        d["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    _family_rules(d, arch, meta)
    try:
        return AutoConfig.for_model(**d).to_dict()
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: cannot build a config from the GGUF metadata ({e})") from None


def _family_rules(d: dict, arch: str, meta: dict) -> None:
    """What llama.cpp fixes in its code rather than in the file, written into d as HF expects it."""
    if arch in ("gemma2", "gemma3"):
        # queries scaled by head_dim ** -0.5, but hidden / heads for the 27B (46 layers Gemma 2, 62 Gemma 3)
        big = d["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
        d["query_pre_attn_scalar"] = (d["hidden_size"] // d["num_attention_heads"] if big
                                      else d.get("head_dim", 256))
    if arch == "gemma3":  # global layers: the file's base and linear scaling; local layers: base 10000
        full = {"rope_type": "default", "rope_theta": d.pop("rope_theta", 1_000_000.0)}
        if meta.get("gemma3.rope.scaling.type") == "linear":
            full.update(rope_type="linear", factor=float(meta["gemma3.rope.scaling.factor"]))
        d["rope_parameters"] = {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        d.setdefault("final_logit_softcapping", None)
    if d["model_type"] == "qwen3_moe":
        d["norm_topk_prob"] = True  # llama.cpp's Qwen3-MoE always renormalizes the chosen experts' weights
