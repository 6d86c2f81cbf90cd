"""The CPU paged attention kernel (cpu_paged_attention.cc): built at first use, called through the XLA FFI.

`cpu_ragged_paged_attention` has the signature and semantics of
`reference.ragged_paged_attention_reference` and reads the K/V pool in place (the handler gets the pool's
buffer). The source is compiled with the system C++ compiler (``$CXX``, else ``g++``) into a cache directory
keyed by the source's hash, jaxlib's version, the compiler, the CPU's flags and the target (``-march=native``;
``$JAXPAGED_CPU_KERNEL_MARCH`` overrides it: ``haswell`` builds the AVX2 path on any newer x86-64), loaded
with ctypes and registered as an FFI target for the CPU platform. `available()` is False (with one log line saying why)
when there is no compiler or the build fails; the attention backend then resolves to the reference.
Quantized pools (int8 / fp8 with k_scale, v_scale) and pool dtypes other than float32 / bfloat16 take the
reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels.reference import (
    _check_heads,
    check_options,
    check_scales,
    ragged_paged_attention_reference,
)

logger = logging.getLogger(__name__)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_paged_attention.cc")
TARGET = "jaxpaged_cpu_paged_attention"
_POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> str:
    # the same root as the engine's caches (~/.cache/jaxpaged), found here without importing the engine:
    # pallas_kernels knows nothing of jaxpaged
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpaged", "cpu_kernels")


def build_kernel(source_path: str = SOURCE) -> str:
    """Compile a kernel source (once per source, jaxlib, compiler and CPU) -> the shared library's path."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found)")
    with open(source_path, "rb") as f:
        source = f.read()
    march = os.environ.get("JAXPAGED_CPU_KERNEL_MARCH", "native")  # e.g. haswell: the AVX2 path on any x86-64
    key = hashlib.sha256(b"\0".join([source, jaxlib.__version__.encode(), cxx.encode(), _cpu_flags().encode(),
                                      march.encode()]))
    out_dir = _cache_dir()
    stem = os.path.splitext(os.path.basename(source_path))[0]
    lib = os.path.join(out_dir, f"{stem}-{key.hexdigest()[:16]}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, "-O3", f"-march={march}", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC",
           "-I", jax.ffi.include_dir(), source_path, "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: concurrent builders agree
    return lib


def load_kernel(source_path: str, handler: str, target: str, instead: str):
    """Build `source_path`, load it and register its FFI `handler` symbol as the CPU `target` -> the loaded
    library; None, with one warning saying what runs `instead`, when that cannot be done here. Call once
    (each kernel module caches it)."""
    try:
        lib = ctypes.cdll.LoadLibrary(build_kernel(source_path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)), platform="cpu")
    except Exception as e:  # noqa: BLE001 — any failure means: the fallback
        logger.warning("CPU kernel %s unavailable, using %s: %s", os.path.basename(source_path), instead, e)
        return None
    return lib


@functools.cache
def _library():
    """The attention kernel's library, built and registered once; None when it cannot be here."""
    return load_kernel(SOURCE, "JaxpagedCpuPagedAttention", TARGET, "the reference attention")


def available() -> bool:
    """The kernel is built, loaded and registered here."""
    return _library() is not None


def vector_lanes() -> int:
    """The float32 lanes of the kernel's vector path in this build: 16 (AVX-512 F, BW, VL), 8 (AVX2 + FMA);
    0 when it has only the plain-loop path (slower than the reference) or is not available."""
    lib = _library()
    return int(lib.JaxpagedCpuAttentionVectorized()) if lib is not None else 0


def vectorized() -> bool:
    """The kernel has its vector path here: the one `attention_backend="auto"` picks on CPU targets."""
    return vector_lanes() > 0


def cpu_ragged_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale=None,
                               window=None, softcap=None, k_scale=None, v_scale=None):
    """Mixed prefill/decode attention over packed queries q [T, Hq, D] -> [T, Hq, D] in q's dtype, the
    reference's semantics; the kernel for float32 / bfloat16 pools, the reference otherwise."""
    _check_heads(q, k_pool)
    check_scales(k_pool, v_pool, k_scale, v_scale)
    check_options(window, softcap)
    if (k_scale is not None or jnp.dtype(k_pool.dtype) not in _POOL_DTYPES or v_pool.dtype != k_pool.dtype
            or not available()):
        return ragged_paged_attention_reference(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc,
                                                scale=scale, window=window, softcap=softcap, k_scale=k_scale,
                                                v_scale=v_scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pool, v_pool, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
               query_start_loc.astype(jnp.int32), scale=np.float32(scale), window=np.int64(window or 0),
               softcap=np.float32(softcap or 0.0))  # [T, Hq, D] float32
    return out.astype(q.dtype)
