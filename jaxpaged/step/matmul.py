"""Which implementation runs the step's weight products: XLA's dot, or the C++ AMX kernel on CPUs that have it.

XLA:CPU's bfloat16 dot does not reach AMX's rate at decode batch sizes (on a 2-core Xeon with amx_bf16:
~80 GFLOP/s at 64 rows, below its float32 dot), so on such CPUs the plain bfloat16 matrices (attention,
MLP, the lm_head; not quantized ones, not MoE experts) go through `pallas_kernels/matmul/cpu.py`, which
reads the weights as stored and multiplies on the tile units with float32 accumulation. The choice is
static for a runner (`ModelConfig.cpu_matmul` of its step config); `quant.dot` follows it.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.matmul import cpu as cpu_matmul


def resolve_matmul(name: str, dtype, platform: str, num_devices: int) -> bool:
    """Whether the step's products use the CPU matmul kernel for `matmul_backend=name` with engine `dtype`
    on `num_devices` devices of `platform`; ValueError naming the reason when 'cpu' cannot run there."""
    if name == "xla":
        return False
    one_cpu_bf16 = platform == "cpu" and num_devices == 1 and jnp.dtype(dtype) == jnp.bfloat16
    if name == "auto":
        return one_cpu_bf16 and cpu_matmul.amx()
    if name != "cpu":
        raise ValueError(f"matmul_backend must be one of auto, xla, cpu, got {name!r}")
    if platform != "cpu":
        raise ValueError(f"matmul_backend='cpu' runs on CPU targets, not {platform}")
    if num_devices != 1:
        raise ValueError(f"matmul_backend='cpu' runs on one device (the kernel has no sharding rule), not on "
                         f"{num_devices}: use tensor_parallel_size 1 or matmul_backend 'xla'")
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"matmul_backend='cpu' multiplies bfloat16 matrices: use dtype 'bfloat16' (got "
                         f"{jnp.dtype(dtype).name})")
    if not cpu_matmul.available():
        raise ValueError("matmul_backend='cpu': the C++ kernel could not be built here (see the log); use 'xla'")
    return True
