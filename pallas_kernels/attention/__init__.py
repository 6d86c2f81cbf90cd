"""Attention over the paged KV pool, one file per implementation: api.py (the operands and their checks),
reference.py (plain JAX, the oracle), triton_decode.py / triton_ragged.py (Pallas Triton),
mosaic_gpu_*.py (Pallas Mosaic GPU), mosaic_tpu.py (Pallas Mosaic TPU), cpu.py + cpu.cc (C++ through the
XLA FFI), backends.py (the ordered registry of what each supports)."""
from pallas_kernels.attention.mosaic_gpu_decode import mosaic_paged_attention
from pallas_kernels.attention.mosaic_gpu_ragged import mosaic_ragged_paged_attention
from pallas_kernels.attention.mosaic_tpu import mosaic_tpu_ragged_paged_attention
from pallas_kernels.attention.reference import (
    paged_attention_reference,
    query_layout,
    ragged_paged_attention_reference,
)
from pallas_kernels.attention.triton_decode import paged_attention
from pallas_kernels.attention.triton_ragged import ragged_paged_attention

__all__ = ["paged_attention", "ragged_paged_attention", "mosaic_paged_attention", "mosaic_ragged_paged_attention",
           "mosaic_tpu_ragged_paged_attention", "paged_attention_reference", "ragged_paged_attention_reference",
           "query_layout"]
