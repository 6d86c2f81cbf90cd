"""jaxpaged: a small LLM inference engine on JAX (paged KV cache, continuous batching, Pallas kernels).

The public API is re-exported here and imported on first use (PEP 562), so that importing a host-side
module such as `jaxpaged.core.scheduler` does not start JAX. The rooms (docs/architecture.md):
`core/` host bookkeeping (never jax), `step/` the jit boundary and what runs inside it, `models/` the pure
model functions, `checkpoints/` loading and converting weights, `parallel/` meshes, replicas, multi-host.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "jaxpaged.llm",
    "LLMEngine": "jaxpaged.engine",
    "EngineConfig": "jaxpaged.config",
    "ModelConfig": "jaxpaged.config",
    "SamplingParams": "jaxpaged.core.sampling_params",
    "RequestOutput": "jaxpaged.core.outputs",
    "CompletionOutput": "jaxpaged.core.outputs",
    "StructuredOutputsParams": "jaxpaged.core.structured",
    "LoRARequest": "jaxpaged.lora.request",
    "BeamSearchParams": "jaxpaged.core.beam_search",
    "BeamSearchOutput": "jaxpaged.core.beam_search",
    "BeamSearchSequence": "jaxpaged.core.beam_search",
    "PoolingParams": "jaxpaged.core.pooling",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
