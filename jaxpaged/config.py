"""ModelConfig (what the checkpoint is; frozen) and EngineConfig (how we run it; validated)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# HF `architectures[0]` -> family; the families differ only in the flags ModelConfig carries.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


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
    qk_norm: bool = False             # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_scaling: tuple | None = None  # llama3: (factor, low_freq_factor, high_freq_factor, original_max)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
                rope_theta=float(_rope_param(d, "rope_theta", 10000.0)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if family == "qwen2":
            kw["attention_bias"] = True
        elif family in ("llama", "mistral", "qwen3"):
            kw["attention_bias"] = bool(d.get("attention_bias", False))
        kw["qk_norm"] = family == "qwen3"
        kw["rope_scaling"] = _rope_scaling(d, source)
        if family == "mistral" or d.get("use_sliding_window", False):
            sw = d.get("sliding_window")
            kw["sliding_window"] = int(sw) if sw else None
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


def _rope_param(d, name, default):
    rp = d.get("rope_parameters") or {}
    return d.get(name) or rp.get(name) or default


def _rope_scaling(d, source):
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    return (float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
            int(rs["original_max_position_embeddings"]))


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
    kv_cache_memory_gb: float = 2.0         # per device: with tensor parallelism each holds 1/N of a block
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None        # None: the model's max_position_embeddings, capped at 4096
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"         # auto | reference | pallas
    tensor_parallel_size: int = 1           # devices one model is split over (heads, MLP columns, vocab)
    seed: int = 0
    async_scheduling: bool | None = None    # None: on for GPU/TPU, off on CPU (see docs/architecture.md)
    max_logprobs: int = 20
    compilation_cache_dir: str | None = field(default_factory=lambda: os.path.join(default_cache_dir(), "xla"))
    warmup: bool = True
    show_progress: bool = True

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_logprobs",
                     "tensor_parallel_size"):
            positive(name)
        if self.dtype == "auto":
            import jax
            self.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        if self.async_scheduling is None:
            import jax
            self.async_scheduling = jax.default_backend() != "cpu"
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
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
