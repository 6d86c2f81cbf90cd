"""jaxpaged: a small LLM inference engine on JAX (paged KV cache, continuous batching, Pallas kernels)."""
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.engine import LLMEngine
from jaxpaged.llm import LLM
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling import SamplingParams
from jaxpaged.structured import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput",
           "CompletionOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"
