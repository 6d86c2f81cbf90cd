"""Which implementation runs the step's weight products: XLA's dot, the C++ bfloat16 kernel, and for int8 /
int4 weights the quantized C++ kernel.

XLA:CPU's bfloat16 dot is far from the CPU's rate at decode batch sizes (on a 2-core Xeon with amx_bf16:
~80 GFLOP/s at 64 rows, below its float32 dot; on a 2-core AVX-512 BF16 EPYC a decode step's products take
7-22x the kernel's time at 1 and 8 rows, docs/results/matmul_bf16_cpu.json), so where
`pallas_kernels/matmul/cpu.py` runs a path measured faster (`AUTO_ISAS`: AMX tiles, AVX-512 BF16, AVX2 + FMA,
the last measured through the `isa` cap on the AVX-512 machine; docs/benchmarks.md) the plain
bfloat16 matrices (attention, MLP, the lm_head; not quantized ones, not MoE experts) go through it: the
weights read as stored or packed once, float32 accumulation. The choice is static for a runner
(`ModelConfig.cpu_matmul` of its step config); `quant.dot` follows it.

Integer-quantized matrices (`quantization` int8 / int4) run on `pallas_kernels/matmul/cpu_quant.py` on one
CPU device where it builds (`resolve_quant_matmul`): the runner packs them at placement
(jaxpaged/models/qpacked.py) and the kernel reads the packed bytes once a step, with integer-quantized
activations (int8 weights: int16 codes in a row's outlier blocks, int8 elsewhere; int8 for int4:
qpacked.act_bits_of, act_outlier_of). Elsewhere (GPU / TPU,
several devices, `matmul_backend="xla"`) XLA dequantizes and multiplies (the reference). `matmul_name` says
which, with the kernels' ISA paths, for `stats()`.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.matmul import cpu as cpu_matmul
from pallas_kernels.matmul import cpu_quant

INTEGER_FORMATS = ("int8", "int4")
# The bfloat16 kernel's paths `auto` picks: each measured faster than XLA's dot at a model's products
# (jaxpaged bench cpu_matmul; docs/benchmarks.md). The scalar loops are not.
AUTO_ISAS = ("amx", "avx512_bf16", "avx2")


def resolve_matmul(name: str, dtype, platform: str, num_devices: int, quantization: str | None = None) -> bool:
    """Whether the step's products use the CPU matmul kernel for `matmul_backend=name` with engine `dtype`
    on `num_devices` devices of `platform`: 'auto' for bfloat16 on one CPU device where the kernel's best
    path is in `AUTO_ISAS`, 'cpu' on any path (the scalar loops included); ValueError naming the reason
    when 'cpu' cannot run there (a non-bfloat16 engine with int8 / int4 weights: those take the quantized
    kernel, the rest XLA's dot)."""
    if name == "xla" or (name == "cpu" and quantization in INTEGER_FORMATS and jnp.dtype(dtype) != jnp.bfloat16):
        return False
    one_cpu_bf16 = platform == "cpu" and num_devices == 1 and jnp.dtype(dtype) == jnp.bfloat16
    if name == "auto":
        return one_cpu_bf16 and cpu_matmul.isa() in AUTO_ISAS
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


def weights_quantization(params: dict, quantization: str | None) -> str | None:
    """The integer format the weights hold for the kernel choice: `quantization`, or for a checkpoint kept
    quantized without it (a GGUF file, a converted directory: `keep_quantized`) the widest integer format of
    its QArray matrices ("int8" where any has 8-bit codes, else "int4"), None where none is one."""
    if quantization is not None:
        return quantization
    import jax

    from jaxpaged.models.qarray import QArray
    formats = {a.format for a in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
               if isinstance(a, QArray)} & set(INTEGER_FORMATS)
    return "int8" if "int8" in formats else "int4" if formats else None


def resolve_quant_matmul(name: str, quantization: str | None, platform: str, num_devices: int) -> bool:
    """Whether int8 / int4 matrices run on the quantized CPU kernel for `matmul_backend=name`: 'auto' where
    it can (one CPU device, the kernel built), 'cpu' there or a ValueError naming why not, 'xla' never."""
    if name == "xla" or quantization not in INTEGER_FORMATS:
        return False
    if platform != "cpu" or num_devices != 1 or not cpu_quant.available():
        if name == "auto":
            return False
        why = (f"runs on CPU targets, not {platform}" if platform != "cpu" else
               f"runs on one device, not {num_devices}" if num_devices != 1 else "could not be built here")
        raise ValueError(f"matmul_backend='cpu': the quantized kernel {why}; use 'xla'")
    return True


def matmul_name(bf16_kernel: bool, quant_kernel: bool) -> str:
    """What runs the weight products, for `stats()`: "cpu_quant (<isa>)" for int8 / int4 matrices, "cpu
    (<isa>)" for bfloat16 ones on the bfloat16 kernel (its path: amx, avx512_bf16, avx2, scalar), "xla" for
    the rest (joined by " + ")."""
    parts = (([f"cpu_quant ({cpu_quant.isa()})"] if quant_kernel else []) +
             ([f"cpu ({cpu_matmul.isa()})"] if bf16_kernel else []))
    return " + ".join(parts + ["xla"] if not bf16_kernel else parts)
