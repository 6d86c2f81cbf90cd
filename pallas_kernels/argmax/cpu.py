"""The index of each row's largest value on the CPU (cpu.cc beside this file), built at first use, called through the
XLA FFI: `cpu_argmax(x)` for float32 x [..., V] -> int32 [...], the first of ties and the first NaN of a row
as `jnp.argmax` (XLA:CPU's own argmax is a reduction over (value, index) pairs that it does not vectorize).
Built and loaded by pallas_kernels/ffi; `available()` is False (one log line says why)
where it cannot be built, and callers keep `jnp.argmax`. The reference is `jnp.argmax`. Only the AVX-512 build
is measured faster than `jnp.argmax` (docs/kernels.md); elsewhere it is a scalar loop, and `auto_skip()` says why
the engine keeps `jnp.argmax`.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels.ffi import load_kernel

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu.cc")
TARGET = "jaxpaged_cpu_argmax"


@functools.cache
def _library():
    """The kernel's library, built and registered once; None when it cannot be here."""
    return load_kernel(SOURCE, "JaxpagedCpuArgmax", TARGET, "jnp.argmax")


def available() -> bool:
    """The kernel is built, loaded and registered here."""
    return _library() is not None


def vector_lanes() -> int:
    """The float32 lanes of the kernel's vector loop in this build: 16 (AVX-512 F); 0 for its scalar loop (AVX2,
    Arm, older x86) or where it is not available."""
    lib = _library()
    return int(lib.JaxpagedCpuArgmaxLanes()) if lib is not None else 0


def auto_skip() -> str | None:
    """Why the engine's sampler keeps `jnp.argmax` on a CPU target rather than this kernel; None where it takes
    the kernel (built here with its AVX-512 loop, the one path a committed bench shows faster)."""
    if not available():
        return "the C++ argmax could not be built here (see the log)"
    if vector_lanes() < 16:
        return ("the C++ argmax has only its scalar loop in this build (unmeasured against jnp.argmax; its AVX-512 "
                "loop is measured)")
    return None


def cpu_argmax(x):
    """x f32[..., V] (V > 0) -> i32[...]: the first index of each row's largest value (NaN counts as largest)."""
    if jnp.dtype(x.dtype) != jnp.float32 or x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"cpu_argmax needs float32 x [..., V] with V > 0, got {x.dtype}{list(x.shape)}")
    if not available():
        raise RuntimeError("the CPU argmax kernel is not available here (see the log for why)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32), vmap_method="sequential")
    return call(x2).reshape(lead)
