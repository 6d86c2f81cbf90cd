"""bfloat16 products on the CPU (cpu.cc beside this file): built at first use, called through the XLA FFI.

`cpu_matmul(x, w, transpose=False)` is `x @ w` (`x @ w.T` when `transpose`: the tied embedding [V, D] as the
lm_head) with float32 accumulation and a float32 result, for bfloat16 x [..., K] and a bfloat16 matrix w
[K, N] (or [N, K]), read as stored, or `pack`ed once ahead of time into the tile order the kernel reads
(`packed=True`), then read without repacking every call; `cpu_matmuls(x, ws)` runs the products of one x
with several matrices (a layer's q, k and v) as one call, one fan-out over all their columns. The kernel's
paths (`ISAS`): AMX tiles, AVX-512 BF16 (`vdpbf16ps`), AVX2 + FMA, scalar loops; `isa()` names the best one
this build runs (compiled with -march=native, AMX where Linux grants the process the tile state), `isa=`
caps it (tests, benchmarks).
`supported(x, w, transpose)` says whether the shapes fit (K % 32 == 0, N % 16 == 0, both bfloat16, w
2-D); otherwise callers use XLA's dot. Built and loaded by pallas_kernels/ffi (the system C++ compiler, a
cache keyed by the source, its headers, jaxlib, the compiler, the flags and the CPU).
"""
from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ffi import load_kernel

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu.cc")
TARGET = "jaxpaged_cpu_matmul"
ISAS = {"scalar": 0, "avx2": 1, "avx512_bf16": 2, "amx": 3}


@functools.cache
def _library():
    """The kernel's library, built and registered once; None when it cannot be here."""
    return load_kernel(SOURCE, "JaxpagedCpuMatmul", TARGET, "XLA's dot")


def available() -> bool:
    """The kernel is built, loaded and registered here (on AMX tiles or as plain loops)."""
    return _library() is not None


@functools.cache
def isa() -> str | None:
    """The best path of this build here: "amx", "avx512_bf16", "avx2" or "scalar"; None when the kernel is not
    available."""
    lib = _library()
    return None if lib is None else {v: k for k, v in ISAS.items()}[int(lib.JaxpagedCpuMatmulIsa())]


def path(K: int, N: int, isa: str | None = None) -> str:
    """The path a call capped at `isa` (default: none) runs for w of K x N here: the build's best up to the
    cap, the scalar loops for shapes the tiles do not fit (K % 32, N % 16)."""
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {tuple(ISAS)} or None, got {isa!r}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU matmul kernel is not available here (see the log for why)")
    got = lib.JaxpagedCpuMatmulPath(ctypes.c_int64(ISAS[isa or "amx"]), ctypes.c_int64(K), ctypes.c_int64(N))
    return {v: k for k, v in ISAS.items()}[int(got)]


def amx() -> bool:
    """The kernel runs on AMX tiles here (compiled for them, and Linux granted the tile state)."""
    return isa() == "amx"


def supported(x, w, transpose: bool = False, stacked: bool = False) -> bool:
    """Whether x [..., K] @ w fits the kernel: both bfloat16, w one matrix (a stack [L, ..] of them when
    `stacked`), K % 32 == 0, N % 16 == 0."""
    if (jnp.dtype(x.dtype) != jnp.bfloat16 or jnp.dtype(w.dtype) != jnp.bfloat16
            or len(w.shape) != 2 + bool(stacked)):
        return False
    n, k = (w.shape[-2:] if transpose else w.shape[-2:][::-1])
    return x.shape[-1] == k and k % 32 == 0 and n % 16 == 0


def pack(w):
    """w [..., K, N] (bfloat16, K % 32 == 0, N % 16 == 0) -> its tiles in the kernel's order [..., N / 16,
    K / 32, 16, 32]: tile (t, kb) row r holds the pairs (w[kb*32 + 2r, c], w[kb*32 + 2r + 1, c]) of the 16
    columns c of t (AMX's B layout), so a product reads every tile once, straight from memory."""
    *lead, k, n = w.shape
    d = len(lead)
    t = w.reshape(*lead, k // 32, 16, 2, n // 16, 16)  # kb, r, pair, t, c
    return t.transpose(*range(d), d + 3, d, d + 1, d + 4, d + 2).reshape(*lead, n // 16, k // 32, 16, 32)


def unpack(tiles):
    """The inverse of `pack`: [..., N / 16, K / 32, 16, 32] -> [..., K, N]."""
    *lead, nt, kb, _, _ = tiles.shape
    d = len(lead)
    t = tiles.reshape(*lead, nt, kb, 16, 16, 2)  # t, kb, r, c, pair
    return t.transpose(*range(d), d + 1, d + 2, d + 4, d, d + 3).reshape(*lead, kb * 32, nt * 16)


def cpu_matmul(x, w, transpose: bool = False, layer=None, packed: bool = False, isa: str | None = None,
               rows=None):
    """x [..., K] @ w [K, N] (w [N, K] when `transpose`; w `pack`ed [N / 16, K / 32, 16, 32] when `packed`)
    -> f32[..., N], bfloat16 operands (see `supported`). With `layer` (an int32 scalar, traced or not), w is
    the stack [L, ...] of such matrices and w[layer] is read in place. rows (an int32 scalar, traced or
    not; default all): how many leading rows of x (flattened to [M, K]) are live; the others pad a token
    bucket and give zeros, not computed. isa: the most capable path to run (one of `ISAS`; default: the
    build's best)."""
    return cpu_matmuls(x, (w,), transpose, layer, packed, isa, rows)[0]


def cpu_matmuls(x, ws, transpose: bool = False, layer=None, packed: bool = False, isa: str | None = None,
                rows=None) -> tuple:
    """(x @ w for w in ws) in one call, each as `cpu_matmul` gives it: the matrices of one x (a layer's q, k
    and v; gate and up), every one in the same form (`transpose`, `packed`, stacked under the same `layer`),
    their column panels shared by the threads as one product's. -> a tuple of f32[..., N_i]."""
    ws = tuple(ws)
    if not ws:
        raise ValueError("cpu_matmuls needs at least one matrix in ws")
    stacked = layer is not None
    widths = []
    for w in ws:
        if packed:
            ok = (not transpose and len(w.shape) == 4 + stacked and tuple(w.shape[-2:]) == (16, 32)
                  and jnp.dtype(x.dtype) == jnp.dtype(w.dtype) == jnp.bfloat16 and x.shape[-1] == w.shape[-3] * 32)
            widths.append(w.shape[-4] * 16)
        else:
            ok = supported(x, w, transpose, stacked)
            widths.append(w.shape[-2] if transpose else w.shape[-1])
        if not ok:
            form = ("packed [N / 16, K / 32, 16, 32]" if packed else "[K, N] (or [N, K] transposed)") + \
                (", stacked [L, ..]" if stacked else "")
            raise ValueError(f"cpu_matmul needs bfloat16 x [..., K] and w {form} with K % 32 == 0 and N % 16 == 0; "
                             f"got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}")
    if stacked and len({w.shape[0] for w in ws}) != 1:
        raise ValueError(f"cpu_matmuls: the stacks in ws must hold as many layers, got {[w.shape[0] for w in ws]}")
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {tuple(ISAS)} or None, got {isa!r}")
    if not available():
        raise RuntimeError("the CPU matmul kernel is not available here (see the log for why)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    live = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32).reshape(())
    shapes = [jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32) for n in widths]
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    ys = call(x2, ws[0], index, live, *ws[1:], transpose=np.int64(transpose), packed=np.int64(packed),
              isa=np.int64(ISAS[isa or "amx"]))
    return tuple(y.reshape(lead + (n,)) for y, n in zip(ys, widths))
