"""ModelConfig (what the checkpoint is; frozen) and EngineConfig (how we run it; validated)."""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxpaged.models.hf_config import FULL, SLIDING, model_config_fields, published_dtype, read_config_json

# what `attention_backend` may ask for; jaxpaged/step/attention.py resolves it for the target devices
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "pallas", "triton", "mosaic", "mosaic_gpu", "mosaic_tpu")
MATMUL_BACKENDS = ("auto", "xla", "cpu")  # resolved by jaxpaged/step/matmul.py


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
    torch_dtype: str | None = None    # the checkpoint's dtype as published (config.json); dtype="auto" follows it
    eos_token_ids: tuple[int, ...] = ()
    row_tile: int = 0                 # the step's, not the model's: products over tiles of rows (batch_invariant)
    cpu_matmul: bool = False          # the step's too: bfloat16 products on the CPU matmul kernel (step/matmul.py)

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


# the choices of EngineConfig's string fields, offered by their flags; the modules named validate them
# (they import jax, which this module must not; tests/test_flags.py checks that the two agree)
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float8_e4m3fn", "int8")  # jaxpaged/step/kv_cache.py
QUANTIZATIONS = (None, "int8", "int4", "fp8")  # jaxpaged/models/qarray.py
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")  # step/sampler.py

# EngineConfig's fields by concern: each is one engine flag (jaxpaged/args.py), shown under its group's title
MODEL, SCHEDULER, CACHE, PARALLEL = "model and loading", "scheduler", "KV cache", "parallel and multi-host"
SPECULATIVE, LORA, RESEARCH, COMPILATION = "speculative decoding", "LoRA adapters", "RL and research", "compilation"


def option(default: Any, group: str, help: str, *, factory: Callable[[], Any] | None = None, **argparse_kw) -> Any:
    """An EngineConfig field: its default (`factory`: made per instance) and, as metadata, its flag's group,
    help and further argparse keywords (choices, metavar). The flag's name, type and default are the field's."""
    metadata = {"group": group, "help": help, **argparse_kw}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _default_compilation_cache_dir() -> str:
    return os.path.join(default_cache_dir(), "xla")


# The embedded default model (SmolLM2-135M-Instruct) is published in bfloat16; its GGUF does not say so, so
# its conversion records it (checkpoints/default_model.py) and model=None resolves "auto" without fetching it.
DEFAULT_MODEL_TORCH_DTYPE = "bfloat16"


def cpu_has_bfloat16() -> bool:
    """Whether this machine's CPU has bfloat16 arithmetic units (x86 AVX512-BF16 or AMX-BF16, Arm BF16):
    where it has not, XLA emulates bfloat16 and float32 is faster."""
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:  # not Linux: no flags to read
        return False
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def auto_dtype(model: str | None) -> str:
    """dtype="auto", as vLLM: the checkpoint's published dtype (config.json's `torch_dtype`; the embedded
    default model's when `model` is None) where the platform computes in it. On CPU: bfloat16 for bfloat16
    and float16 checkpoints where the CPU has bfloat16 units, float32 otherwise. On GPU/TPU: the published
    bfloat16 or float16, bfloat16 for float32 checkpoints."""
    import jax
    published = _published_dtype(model)
    if jax.default_backend() == "cpu":
        return "bfloat16" if published in ("bfloat16", "float16") and cpu_has_bfloat16() else "float32"
    return published if published in ("bfloat16", "float16") else "bfloat16"


def _published_dtype(model: str | None) -> str | None:
    if model is None:
        return DEFAULT_MODEL_TORCH_DTYPE
    try:
        with open(os.path.join(model, "config.json")) as f:
            return published_dtype(json.load(f))
    except (OSError, ValueError, AttributeError):  # no (readable) config: the engine's loading names the problem
        return None


@dataclass
class EngineConfig:
    """How to run a model. Every field is checked in __post_init__; errors name the field. Every field is
    also an engine flag of `jaxpaged generate | serve` and the bench scripts (`--max-num-seqs` for
    max_num_seqs; jaxpaged/args.py), documented by the help in its metadata."""

    # -- model and loading
    model: str | None = option(None, MODEL, "a Hugging Face or converted model directory, or a GGUF file "
                               "(default: the embedded default model, SmolLM2-135M-Instruct)")
    dtype: str = option("auto", MODEL, "weights and activations; auto: the checkpoint's torch_dtype where the "
                        "hardware computes in it (bfloat16 on CPUs with bfloat16 units: AVX512-BF16, AMX, Arm "
                        "BF16), else float32 on CPU, bfloat16 on GPU/TPU", choices=DTYPES)
    quantization: str | None = option(None, MODEL, "weight-only quantization of the layer matrices, from any "
                                      "float checkpoint at load (default: none, the weights' dtype); int8 / int4: "
                                      "integer codes with scales per group (quantization_group_size) and a "
                                      "per-group minimum (quantization_symmetric), the "
                                      "embedding and lm_head int8 in groups of 32; fp8: per output "
                                      "channel", choices=QUANTIZATIONS[1:])
    quantization_group_size: int | None = option(None, MODEL, "entries of the input axis each int8 / int4 scale "
                                                 "covers: 16, 32, 64, 128, or 0 / -1 for one per output channel "
                                                 "(default: 32)")
    quantization_symmetric: bool | None = option(None, MODEL, "int4: symmetric codes -7..7 times a scale "
                                                 "(llama.cpp's Q4_0 form), or --no-quantization-symmetric: codes "
                                                 "0..15 times a scale plus a per-group minimum (Q4_1 / Q4_K's "
                                                 "form; AWQ / GPTQ call it a zero point); int8 likewise: "
                                                 "-127..127, or 0..255 plus a minimum; fp8 is symmetric "
                                                 "(default: int4 and int8 with a minimum)")
    quantization_activation_bits: int | None = option(None, MODEL, "int8 / int4 weights on the quantized CPU "
                                                      "kernel: the codes it rounds the activations to per block "
                                                      "of inputs (32, or the scale group up to 128: one scale "
                                                      "per channel takes 128), 16 (int16 everywhere: the float "
                                                      "product's quality) or 8 (int8: up to ~1.8x faster "
                                                      "products at many rows, more error); default for 8-bit "
                                                      "weight codes int16 in each row's outlier blocks and int8 "
                                                      "elsewhere (qpacked.AUTO_ACT_OUTLIER), 8 for 4-bit")
    keep_quantized: bool = option(True, MODEL, "a GGUF model (--model x.gguf): its Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                                  "Q4_K, Q5_K, Q6_K matrices stay quantized, exactly (dtype then sets the "
                                  "activations and the float tensors), as do the quantized matrices of a "
                                  "directory `jaxpaged convert` wrote; --no-keep-quantized dequantizes them")
    max_model_len: int | None = option(None, MODEL, "longest prompt + output (default: the model's "
                                       "max_position_embeddings, capped at 4096)")
    max_logprobs: int = option(20, MODEL, "most logprobs a request may ask for, per token")
    enable_prompt_embeds: bool = option(False, MODEL, "accept prompts given as embeddings (prompt_embeds "
                                        "[prompt_len, hidden], vLLM's), fed to the first layer in place of the "
                                        "token lookup (jaxpaged/step/prompt_embeds.py)")
    seed: int = option(0, MODEL, "seed of the engine's random stream, from which a request without a seed of "
                       "its own draws one")
    # -- pooling (jaxpaged/core/pooling.py, jaxpaged/step/pooling.py): embeddings from the final-norm states
    runner: str = option("auto", MODEL, "generate, or pooling: also serve embeddings (LLM.embed, /v1/embeddings, "
                         "/pooling, /score, /rerank) from the model's pooled final-norm hidden states; auto: pooling "
                         "when --convert embed", choices=("auto", "generate", "pooling"))
    convert: str = option("auto", MODEL, "embed: serve the decoder language model as an embedding model (vLLM's "
                          "--convert; implies --runner pooling)", choices=("auto", "none", "embed"))
    pooler_config: Any = option(None, MODEL, 'as JSON: \'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": '
                                'true}\' (default: LAST, normalized)', metavar="JSON")
    # -- scheduler
    max_num_seqs: int = option(64, SCHEDULER, "batch slots: requests that run at once")
    max_num_batched_tokens: int = option(512, SCHEDULER, "token budget of one step, prefill chunks and decodes "
                                         "together")
    async_scheduling: bool | None = option(None, SCHEDULER, "prepare step t+1 while step t runs on the device "
                                           "(default: on for GPU/TPU, off on CPU; see docs/architecture.md)")
    # -- KV cache
    block_size: int = option(16, CACHE, "tokens per KV block")
    num_kv_blocks: int | None = option(None, CACHE, "KV blocks in the pool, the null block included (default: "
                                       "as many as --kv-cache-memory-gb allows)")
    kv_cache_memory_gb: float = option(2.0, CACHE, "GB of KV cache per device (with tensor parallelism each "
                                       "device holds 1/N of every block)")
    kv_cache_dtype: str = option("auto", CACHE, "KV cache storage; auto: the dtype; int8 / float8_e4m3fn: one "
                                 "scale per token per KV head (jaxpaged/step/kv_cache.py)", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(True, CACHE, "share the full KV blocks of equal prefixes between requests")
    # -- parallel and multi-host (docs/scale-out.md)
    tensor_parallel_size: int = option(1, PARALLEL, "devices one model is split over (heads, MLP columns, vocab)")
    data_parallel_size: int = option(1, PARALLEL, "replicas, each on its own --tensor-parallel-size devices, "
                                     "behind one front (routed by load and prefix)")
    coordinator_address: str | None = option(None, PARALLEL, "multi-host: HOST:PORT of process 0 (as "
                                             "jax.distributed.initialize); every process gets the same flags")
    num_processes: int = option(1, PARALLEL, "multi-host: processes in the job")
    process_id: int = option(0, PARALLEL, "multi-host: this process (0 schedules and serves, the others follow)")
    distributed_timeout: float = option(60.0, PARALLEL, "multi-host: seconds a step may take before the leader "
                                        "declares a follower lost")
    # -- speculative decoding (jaxpaged/spec_decode/): a dict, JSON string or SpeculativeConfig; None: off
    speculative_config: Any = option(None, SPECULATIVE, 'as JSON: \'{"method": "ngram", "num_speculative_tokens": '
                                     '4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": '
                                     '"draft_model", "model": "DIR", "num_speculative_tokens": 4}\' (default: off)',
                                     metavar="JSON")
    # -- LoRA adapters (jaxpaged/lora/): device slots, the rank they are padded to, the host cache
    enable_lora: bool = option(False, LORA, "run LoRA adapters: each request may name one")
    max_loras: int = option(1, LORA, "adapters on the device at once")
    max_lora_rank: int = option(16, LORA, "largest adapter rank")
    max_cpu_loras: int | None = option(None, LORA, "adapters kept in host memory (default: --max-loras)")
    # -- RL and research (docs/research.md); layer indices as transformers' output_hidden_states
    logprobs_mode: str = option("raw_logprobs", RESEARCH, "what logprobs describe: the model's raw distribution "
                                "(raw_logprobs, raw_logits) or the one tokens are drawn from (processed_logprobs, "
                                "processed_logits; jaxpaged/step/sampler.py)", choices=LOGPROBS_MODES)
    batch_invariant: bool = option(False, RESEARCH, "a request's tokens and logprobs bit for bit independent of "
                                   "the other requests in its steps (slower; jaxpaged/step/batch_invariant.py)")
    hidden_state_layers: list[int] | None = option(None, RESEARCH, "residual-stream states captured, by layer "
                                                   "index (0..num_layers)", metavar="LAYER")
    steering_layers: list[int] | None = option(None, RESEARCH, "layers where per-request steering vectors are "
                                               "added (0..num_layers-1)", metavar="LAYER")
    # -- compilation
    attention_backend: str = option("auto", COMPILATION, "attention kernels, resolved for the devices the step is "
                                    "compiled for (jaxpaged/step/attention.py; 'cpu': the C++ kernel that reads "
                                    "the paged pool in place, CPU targets only)", choices=ATTENTION_BACKENDS)
    matmul_backend: str = option("auto", COMPILATION, "the weight products (jaxpaged/step/matmul.py): 'auto' runs "
                                 "bfloat16 steps on one CPU device on the C++ kernel where it has a path measured "
                                 "faster than XLA's dot (AMX, AVX-512 BF16, AVX2 + FMA), XLA's dot elsewhere; "
                                 "'xla': XLA's dot always; 'cpu': the C++ kernel on any CPU (scalar loops "
                                 "without AVX2: slow)", choices=MATMUL_BACKENDS)
    compilation_cache_dir: str | None = option(None, COMPILATION, "JAX's persistent compilation cache, so a second "
                                               "start is fast ('': none)", factory=_default_compilation_cache_dir)
    warmup: bool = option(True, COMPILATION, "compile every step shape at start-up (off: each on first use)")
    show_progress: bool = option(True, COMPILATION, "progress bars (compilation at start-up, LLM.generate)")

    def __post_init__(self):
        from jaxpaged.step.host_malloc import one_heap
        one_heap()  # before the first jax.default_backend() starts XLA's CPU client and its threads
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_logprobs",
                     "tensor_parallel_size"):
            positive(name)
        from jaxpaged.spec_decode.config import SpeculativeConfig, check_draft_engine, check_engine
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.async_scheduling is None:
            import jax
            self.async_scheduling = jax.default_backend() != "cpu" and self.speculative_config is None
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.model)
        if self.dtype not in DTYPES[1:]:
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        from jaxpaged.step.kv_cache import check_kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
            if self.num_kv_blocks < 2:
                raise ValueError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.matmul_backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul_backend must be one of {', '.join(MATMUL_BACKENDS)}, "
                             f"got {self.matmul_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not isinstance(self.enable_prompt_embeds, bool):
            raise ValueError(f"enable_prompt_embeds must be a bool, got {self.enable_prompt_embeds!r}")
        if not isinstance(self.keep_quantized, bool):
            raise ValueError(f"keep_quantized must be a bool, got {self.keep_quantized!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        from jaxpaged.models.qarray import check_quantization, group_of, symmetric_of
        check_quantization(self.quantization)
        if self.quantization_activation_bits not in (None, 8, 16):
            raise ValueError(f"quantization_activation_bits must be 8, 16 or None, got "
                             f"{self.quantization_activation_bits!r}")
        if self.quantization is not None:
            group_of(self.quantization, self.quantization_group_size)  # ValueError naming the field
            symmetric_of(self.quantization, self.quantization_symmetric)
        elif self.quantization_group_size is not None:
            raise ValueError(f"quantization_group_size={self.quantization_group_size} needs quantization "
                             "'int8' or 'int4'")
        elif self.quantization_symmetric is not None:
            raise ValueError(f"quantization_symmetric={self.quantization_symmetric} needs quantization 'int4' "
                             "(or 'int8' / 'fp8' with True)")
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
        from jaxpaged.core.pooling import PoolerConfig, pooling_enabled
        self.pooling = pooling_enabled(self.runner, self.convert)  # not a field: no flag of its own
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
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
