"""ModelConfig (what the checkpoint is; frozen) and EngineConfig (how we run it; validated)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from jaxpaged.models.hf_config import FULL, SLIDING, model_config_fields, read_config_json

# what `attention_backend` may ask for; jaxpaged/step/attention.py resolves it for the target devices
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "triton", "mosaic", "mosaic_gpu", "mosaic_tpu")


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
    row_tile: int = 0                 # the step's, not the model's: products over tiles of rows (batch_invariant)

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
        """From a Hugging Face config dict (jaxpaged/models/hf_config.py reads it family by family)."""
        return cls(**model_config_fields(d, source))

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """From the config.json of model directory `path`."""
        return cls.from_hf_dict(*read_config_json(path))


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpaged")


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")  # step/sampler.py


@dataclass
class EngineConfig:
    """How to run a model. Every field is checked in __post_init__; errors name the field."""

    model: str | None = None
    dtype: str = "auto"                     # auto: bfloat16 on GPU/TPU, float32 on CPU (see README)
    kv_cache_dtype: str = "auto"            # auto (the dtype) | bfloat16 | float8_e4m3fn | int8 (jaxpaged/step/kv_cache.py)
    block_size: int = 16
    num_kv_blocks: int | None = None        # None: as many as kv_cache_memory_gb allows
    kv_cache_memory_gb: float = 2.0         # per device: with tensor parallelism each holds 1/N of a block
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None        # None: the model's max_position_embeddings, capped at 4096
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"         # one of ATTENTION_BACKENDS (jaxpaged/step/attention.py)
    tensor_parallel_size: int = 1           # devices one model is split over (heads, MLP columns, vocab)
    quantization: str | None = None         # weight-only: None, "int8" or "fp8" (per-output-channel scales)
    seed: int = 0
    async_scheduling: bool | None = None    # None: on for GPU/TPU, off on CPU (see docs/architecture.md)
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"     # raw_ | processed_ logprobs | logits (jaxpaged/step/sampler.py)
    batch_invariant: bool = False           # a request's bits independent of the batch (step/batch_invariant.py)
    compilation_cache_dir: str | None = field(default_factory=lambda: os.path.join(default_cache_dir(), "xla"))
    warmup: bool = True
    show_progress: bool = True
    # research hooks compiled into the step (docs/research.md); indices as transformers' output_hidden_states
    hidden_state_layers: list[int] | None = None  # residual-stream states captured (0..num_layers)
    steering_layers: list[int] | None = None      # where per-request steering vectors are added (0..num_layers-1)
    # LoRA adapters (jaxpaged/lora/): device slots, the rank they are padded to, the host cache (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # scale-out beyond one engine (docs/scale-out.md)
    data_parallel_size: int = 1             # replicas, each on its own tensor_parallel_size devices
    coordinator_address: str | None = None  # multi-host: HOST:PORT of process 0 (jax.distributed)
    num_processes: int = 1                  # multi-host: processes in the job
    process_id: int = 0                     # multi-host: this process (0 leads: schedules and serves)
    distributed_timeout: float = 60.0       # multi-host: seconds a step may take before the leader fails it
    # speculative decoding (jaxpaged/spec_decode/): {"method": "ngram", "num_speculative_tokens": k, ...}
    speculative_config: Any = None          # dict, JSON string or SpeculativeConfig; None: off

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
        from jaxpaged.spec_decode.config import SpeculativeConfig, check_draft_engine, check_engine
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.async_scheduling is None:
            import jax
            self.async_scheduling = jax.default_backend() != "cpu" and self.speculative_config is None
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        from jaxpaged.step.kv_cache import check_kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
            if self.num_kv_blocks < 2:
                raise ValueError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        from jaxpaged.models.quant import check_quantization
        check_quantization(self.quantization)
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        self._check_scale_out(positive)
        self._check_lora(positive)
        for name in ("hidden_state_layers", "steering_layers"):  # ranges: at load (research.check_layers)
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                raise ValueError(f"{name} must be a list of layer indices or None, got {v!r}")
        if self.speculative_config is not None:
            check_engine(self)
            if self.speculative_config.method == "draft_model":
                check_draft_engine(self)
        if self.steering_layers and self.num_processes > 1:
            raise ValueError("steering_layers is not supported with num_processes > 1 (the followers "
                             "would not see the per-slot vectors)")

    def _check_lora(self, positive) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            positive(name)
        if self.max_cpu_loras is not None:
            positive("max_cpu_loras")
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.batch_invariant:
            raise ValueError("enable_lora is not supported with batch_invariant=True (the LoRA product is "
                             "not computed in fixed row tiles)")
        if self.enable_lora and (self.num_processes > 1 or self.data_parallel_size > 1):
            raise ValueError("enable_lora is not supported with num_processes > 1 or data_parallel_size > 1")

    def _check_scale_out(self, positive) -> None:
        for name in ("data_parallel_size", "num_processes"):
            positive(name)
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id!r}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(f"num_processes={self.num_processes} needs coordinator_address (HOST:PORT)")
        if self.coordinator_address is not None:
            host, _, port = str(self.coordinator_address).rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"coordinator_address must be HOST:PORT, got {self.coordinator_address!r}")
        if self.num_processes > 1 and self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} with num_processes="
                             f"{self.num_processes} is not supported: multi-host runs one replica over "
                             "every process's devices")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout!r}")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
