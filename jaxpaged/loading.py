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
    """The model directory: the configured one, or the embedded default model (fetched when missing)."""
    path = cfg.model
    if path is None:
        from jaxpaged.checkpoints.default_model import default_model_dir
        path = default_model_dir()
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
        params = load_params(path, mc, cfg.dtype, progress=bar, quantization=cfg.quantization,
                             group_size=cfg.quantization_group_size)
    return params, time.perf_counter() - t0


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
