"""ModelConfig (what the checkpoint is; frozen) and EngineConfig (how we run it; validated)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

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
GEMMA = ("gemma2", "gemma3")
MOE = ("mixtral", "qwen3_moe", "olmoe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projections carry a bias (Qwen2)
    qk_norm: str | None = None        # RMSNorm on q and k before RoPE: "head" (Qwen3, Gemma 3), "flat" (OLMoE)
    # RoPE scaling of full-attention layers: ("llama3", factor, low_freq_factor, high_freq_factor,
    # original_max), ("linear", factor) or ("longrope", short_factor tuple, attention factor)
    rope_scaling: tuple | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers (Gemma 3), unscaled
    sliding_window: int | None = None  # a query at p sees keys p - window < k <= p on sliding layers
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL (filled in __post_init__)
    hidden_act: str = "silu"          # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_plus_one: bool = False       # RMSNorm scales by (1 + w) (Gemma)
    sandwich_norms: bool = False      # extra norms after attention and after the MLP (Gemma 2/3)
    embed_scale: bool = False         # embeddings times sqrt(hidden), rounded to the param dtype (Gemma)
    query_scale: float | None = None  # attention logit scale; None: head_dim ** -0.5
    attn_softcap: float | None = None   # attention logits -> c * tanh(logits / c) (Gemma 2)
    final_softcap: float | None = None  # output logits likewise (Gemma 2/3)
    num_experts: int = 0              # MoE: experts per layer (0: dense MLP)
    num_experts_per_tok: int = 0      # MoE: top-k
    moe_intermediate_size: int = 0    # MoE: F of each expert
    norm_topk_prob: bool = False      # MoE: renormalize the top-k router probabilities
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types:
            kind = SLIDING if self.sliding_window else FULL
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)

    def layer_window(self, i: int) -> int | None:
        """The attention window of layer i (None: all earlier keys)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer slides (Mistral): blocks behind the window are dead and may be freed."""
        return self.sliding_window is not None and all(t == SLIDING for t in self.layer_types)

    @property
    def layer_period(self) -> int:
        """Smallest p with layer_types[i] == layer_types[i % p]: layers are scanned in groups of p."""
        t = self.layer_types
        return next(p for p in range(1, len(t) + 1) if all(t[i] == t[i % p] for i in range(len(t))))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
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
                kw.update(_moe_fields(d, family, source))
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
        act_field = "hidden_activation" if family in GEMMA else "hidden_act"
        act = d.get(act_field) or ("gelu_pytorch_tanh" if family in GEMMA else "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"{source}: {act_field} {act!r} is not supported (only {', '.join(ACTIVATIONS)})")
        kw["hidden_act"] = act
        if family == "qwen2":
            kw["attention_bias"] = True
        elif family in ("llama", "mistral", "qwen3", "phi3", "mixtral", "qwen3_moe", "olmoe") + GEMMA:
            kw["attention_bias"] = bool(d.get("attention_bias", False))
        kw["qk_norm"] = {"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmoe": "flat"}.get(family)
        if family == "olmoe" and d.get("clip_qkv") is not None:
            raise ValueError(f"{source}: clip_qkv {d['clip_qkv']!r} is not supported (only null)")
        if family == "phi3" and float(_rope_param(d, "partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor {_rope_param(d, 'partial_rotary_factor', 1.0)!r}"
                             " is not supported (only 1.0)")
        kw.update(_rope_fields(d, family, kw, source))
        kw.update(_window_fields(d, family, kw["num_layers"], source))
        if family in GEMMA:
            kw.update(norm_plus_one=True, sandwich_norms=True, embed_scale=True,
                      query_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
                      attn_softcap=_positive_or_none(d, "attn_logit_softcapping", source),
                      final_softcap=_positive_or_none(d, "final_logit_softcapping", source))
        eos = d.get("eos_token_id")
        kw["eos_token_ids"] = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        kw["bos_token_id"] = d.get("bos_token_id")
        if kw["num_heads"] % kw["num_kv_heads"]:
            raise ValueError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        return cls(**kw)

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise ValueError(f"{path}: not a model directory (no config.json)")
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: cannot read config: {e}") from None
        return cls.from_hf_dict(d, source=f)


def _positive_or_none(d, name, source):
    v = d.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{source}: {name} must be a positive number or null, got {v!r}")
    return float(v)


def _moe_fields(d, family, source):
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


def _window_fields(d, family, num_layers, source):
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


def _rope_param(d, name, default):
    rp = d.get("rope_parameters") or {}
    if FULL in rp:  # per layer type (Gemma 3)
        rp = rp[FULL]
    return d.get(name) or rp.get(name) or default


def _rope_fields(d, family, kw, source):
    """rope_theta, rope_scaling and (Gemma 3) the local RoPE base, from old- or new-style configs."""
    rp = d.get("rope_parameters") or {}
    out = {"rope_theta": float(_rope_param(d, "rope_theta", 10000.0))}
    if family == "gemma3":
        local = (rp.get(SLIDING) or {}) if FULL in rp else {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope_parameters.{SLIDING}.rope_type {local['rope_type']!r} is not "
                             "supported (only 'default')")
        out["rope_local_theta"] = float(local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0)
        if "rope_theta" not in d and not rp.get(FULL, {}).get("rope_theta"):
            out["rope_theta"] = 1_000_000.0
    rs = d.get("rope_scaling") or (rp.get(FULL) if FULL in rp else rp)
    out["rope_scaling"] = _rope_scaling(rs, family, d, kw, source)
    return out


def _rope_scaling(rs, family, d, kw, source):
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
        # the short factors are exact up to original_max_position_embeddings; HF switches to the long
        # factors beyond it (recomputing every key), which a KV cache cannot: cap the length there
        orig = int(d.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings"))
        short = tuple(float(x) for x in rs["short_factor"])
        if len(short) != kw["head_dim"] // 2:
            raise ValueError(f"{source}: rope_scaling short_factor must have head_dim/2 = {kw['head_dim'] // 2}"
                             f" entries, got {len(short)}")
        factor = rs.get("factor") or kw["max_position_embeddings"] / orig
        attn = rs.get("attention_factor") or (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
        kw["max_position_embeddings"] = min(kw["max_position_embeddings"], orig)
        return ("longrope", short, float(attn))
    raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported "
                     "(only 'llama3', 'linear', 'longrope')")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpaged")


@dataclass
class EngineConfig:
    """How to run a model. Every field is checked in __post_init__; errors name the field."""

    model: str | None = None
    dtype: str = "auto"                     # auto: bfloat16 on GPU/TPU, float32 on CPU (XLA's bf16 CPU dots are slow)
    block_size: int = 16
    num_kv_blocks: int | None = None        # None: as many as kv_cache_memory_gb allows
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None        # None: the model's max_position_embeddings, capped at 4096
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"         # auto | reference | pallas
    seed: int = 0
    max_logprobs: int = 20
    compilation_cache_dir: str | None = field(default_factory=lambda: os.path.join(default_cache_dir(), "xla"))
    warmup: bool = True
    show_progress: bool = True

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_logprobs"):
            positive(name)
        if self.dtype == "auto":
            import jax
            self.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
            if self.num_kv_blocks < 2:
                raise ValueError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.attention_backend not in ("auto", "reference", "pallas"):
            raise ValueError(f"attention_backend must be 'auto', 'reference' or 'pallas', got {self.attention_backend!r}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
