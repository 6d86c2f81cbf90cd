"""What the engine does before its first step: find the model, check the engine against it, load the
weights, and size the KV pool. Each step of start-up is a function here; `LLMEngine.__init__` calls them
in order, so a bad configuration fails before the weights load."""
from __future__ import annotations

import os
import time

from jaxpaged.checkpoints.weights import count_tensors, load_params
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.core.tokenizer import generation_eos_ids
from jaxpaged.step.research import check_layers
from jaxpaged.step.runner import kv_bytes_per_block


def model_dir(cfg: EngineConfig) -> str:
    """The model directory: the configured one, the directory of a GGUF file (checkpoints/gguf_load.py), or
    the embedded default model (fetched when missing)."""
    path = cfg.model
    if path is None:
        from jaxpaged.checkpoints.default_model import default_model_dir
        path = default_model_dir()
    from jaxpaged.checkpoints.gguf_load import gguf_model_dir, is_gguf_file
    if is_gguf_file(path):
        return gguf_model_dir(path)
    if not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist")
    return path


def check_hooks(cfg: EngineConfig, mc: ModelConfig) -> None:
    """Normalize the research hooks' layer lists (ValueError naming a layer the model does not have)."""
    cfg.hidden_state_layers = list(check_layers("hidden_state_layers", cfg.hidden_state_layers,
                                                mc.num_layers, mc.num_layers)) or None
    cfg.steering_layers = list(check_layers("steering_layers", cfg.steering_layers,
                                            mc.num_layers, mc.num_layers - 1)) or None


def max_model_len(cfg: EngineConfig, mc: ModelConfig) -> int:
    """The configured max_model_len (default: the model's, at most 4096), checked against the model."""
    limit = mc.max_position_embeddings
    n = cfg.max_model_len or min(limit, 4096)
    if n > limit:
        raise ValueError(f"max_model_len ({n}) exceeds the model's max_position_embeddings ({limit})")
    return n


def eos_token_ids(mc: ModelConfig, tokenizer, path: str) -> frozenset[int]:
    """Every token that ends a generation: the config's, generation_config.json's and the tokenizer's."""
    eos = set(mc.eos_token_ids) | generation_eos_ids(path)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


def load_weights(path: str, mc: ModelConfig, cfg: EngineConfig) -> tuple[dict, float]:
    """The parameter pytree on the host (with a progress bar), and the seconds it took."""
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    with tqdm(total=count_tensors(mc), desc="loading weights", unit="tensor", disable=not cfg.show_progress) as bar:
        params = _load_gguf(path, mc, cfg, bar)
        if params is None:
            params = load_params(path, mc, cfg.dtype, progress=bar, quantization=cfg.quantization,
                                 group_size=cfg.quantization_group_size, symmetric=cfg.quantization_symmetric,
                                 keep_quantized=cfg.keep_quantized)
    return params, time.perf_counter() - t0


def _load_gguf(path: str, mc: ModelConfig, cfg: EngineConfig, bar) -> dict | None:
    """The weights of a GGUF model directory from its file (None for any other directory): its quantized
    matrices kept (cfg.keep_quantized, no cfg.quantization), or dequantized (and quantized to
    cfg.quantization when set)."""
    from jaxpaged.checkpoints.gguf_load import gguf_source, load_gguf_params
    src = gguf_source(path)
    if src is None:
        return None
    if cfg.quantization:
        from jaxpaged.checkpoints.gguf import GGUFModel
        from jaxpaged.checkpoints.weights import params_from_named_tensors
        return params_from_named_tensors(mc, GGUFModel(src).tensors(), cfg.dtype, source=src, progress=bar,
                                         quantization=cfg.quantization, group_size=cfg.quantization_group_size,
                                         symmetric=cfg.quantization_symmetric)
    return load_gguf_params(src, mc, cfg.dtype, keep_quantized=cfg.keep_quantized, progress=bar)


def num_kv_blocks(cfg: EngineConfig, mc: ModelConfig, model_len: int) -> int:
    """Blocks in the KV pool: num_kv_blocks, or what kv_cache_memory_gb holds (at most what max_num_seqs
    requests of max_model_len tokens can use), block 0 (the null block) included."""
    per_seq = -(-model_len // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = kv_bytes_per_block(mc, cfg.block_size, cfg.dtype, cfg.tensor_parallel_size, cfg.kv_cache_dtype)
    n = int(cfg.kv_cache_memory_gb * 2 ** 30) // per_block
    if n < per_seq + 1:
        raise ValueError(f"kv_cache_memory_gb={cfg.kv_cache_memory_gb} holds {n} blocks, fewer than one "
                         f"max_model_len ({model_len}) request needs ({per_seq}); raise it")
    return min(n, cfg.max_num_seqs * per_seq + 1)
