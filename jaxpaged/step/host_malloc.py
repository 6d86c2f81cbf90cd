"""Freed host memory kept mapped (glibc; engines on CPU devices). XLA's CPU client allocates a step's buffers with
malloc. By default glibc gives the free memory at the top of a heap back to the kernel once it exceeds a trim
threshold, and serves large blocks by mmap, so the next step's buffers are fresh pages again, each one faulted in
and zeroed by the kernel: ~500 minor faults a step of a lone request on the 1B-class Q4_K model (the head's
logits, the quantized products' padding-row outputs: `jaxpaged bench step_parts`), none with the settings here.
`keep_freed_memory` sets glibc's trim threshold to 1 GiB and its mmap threshold to its largest, 32 MiB (blocks
above it). It is process-wide: the process keeps the memory of its busiest step instead of returning it between
steps.

Those thresholds miss one block: XLA allocates a step's temporaries as one block per call on one of its worker
threads (~90 MB for the default model's bfloat16 step at 64 running), and a worker thread's arena cannot hold a
block over 64 MB, so glibc maps it fresh every call whatever the thresholds: ~3,300 faults a step there (the
head's logits f32[64, 49152]). `one_heap` has every thread allocate from the main heap (one arena) and never
mmap a block, so that block too is the same memory every step (weights included: they live in the heap, and
`release_host_memory`'s malloc_trim hands freed pages back on request). It must run before XLA's CPU client
starts its threads (each keeps the arena it took at its start): `EngineConfig` calls it before it first asks
JAX for its backend; in a process that started JAX earlier the worker threads keep their arenas."""
from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8  # <malloc.h>
TRIM, MMAP = 1 << 30, 32 << 20  # bytes; MMAP: glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)


def _mallopt():
    """glibc's mallopt, or None (not Linux, or a libc without it)."""
    if not sys.platform.startswith("linux"):
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's trim and mmap thresholds (once a process) -> whether it took both (False off glibc)."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_TRIM_THRESHOLD, TRIM) == 1 and mallopt(M_MMAP_THRESHOLD, MMAP) == 1


@functools.cache
def one_heap() -> bool:
    """Have glibc serve every thread from the main heap and never mmap a block (once a process; module
    docstring) -> whether it took both (False off glibc)."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1 and mallopt(M_MMAP_MAX, 0) == 1
