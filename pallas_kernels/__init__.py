"""The engine's kernels, one folder per op (arrays in, arrays out), and the loader of the C++ ones.

- ``attention/``: attention over the paged KV pool. ``paged_attention`` (decode, one query per slot) and
  ``ragged_paged_attention`` (prefill chunks and decodes packed by ``query_start_loc``) on Pallas Triton;
  ``mosaic_paged_attention``, ``mosaic_ragged_paged_attention``: the same two on Mosaic GPU (Hopper,
  sm_90a); ``mosaic_tpu_ragged_paged_attention``: the same contract on TPU (Pallas Mosaic TPU), one kernel
  for decode and mixed steps; the C++ CPU kernel (attention/cpu.py); ``*_reference``: plain ``jax.numpy``
  versions, the oracle of the kernel tests; attention/backends.py: what each implementation supports.
- ``matmul/``: bfloat16 products on the CPU's AMX tiles, and int8 / int4 weight products (C++).
- ``argmax/``: each row's largest value's index on the CPU (C++).
- ``ffi/``: the C++ kernels' loader (build, cache, load, register) and their shared header.
"""
from pallas_kernels.attention import (
    mosaic_paged_attention,
    mosaic_ragged_paged_attention,
    mosaic_tpu_ragged_paged_attention,
    paged_attention,
    paged_attention_reference,
    query_layout,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = ["paged_attention", "ragged_paged_attention", "mosaic_paged_attention", "mosaic_ragged_paged_attention",
           "mosaic_tpu_ragged_paged_attention", "paged_attention_reference", "ragged_paged_attention_reference",
           "query_layout"]
