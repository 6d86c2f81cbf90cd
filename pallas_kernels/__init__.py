"""Pallas paged-attention kernels and their plain-JAX references (arrays in, arrays out).

- ``paged_attention``: decode, one query per slot.
- ``ragged_paged_attention``: prefill chunks and decodes packed by ``query_start_loc``.
- ``mosaic_paged_attention``, ``mosaic_ragged_paged_attention``: the same two on Mosaic GPU (Hopper, sm_90a).
- ``mosaic_tpu_ragged_paged_attention``: the same contract on TPU (Pallas Mosaic TPU), one kernel for
  decode and mixed steps.
- ``*_reference``: plain ``jax.numpy`` versions, the CPU path and the oracle of the kernel tests.
"""
from pallas_kernels.mosaic_gpu_decode import mosaic_paged_attention
from pallas_kernels.mosaic_gpu_ragged import mosaic_ragged_paged_attention
from pallas_kernels.mosaic_tpu_ragged import mosaic_tpu_ragged_paged_attention
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import paged_attention_reference, query_layout, ragged_paged_attention_reference

__all__ = ["paged_attention", "ragged_paged_attention", "mosaic_paged_attention", "mosaic_ragged_paged_attention",
           "mosaic_tpu_ragged_paged_attention", "paged_attention_reference", "ragged_paged_attention_reference",
           "query_layout"]
