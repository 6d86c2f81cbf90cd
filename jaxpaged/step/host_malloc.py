"""Freed host memory kept mapped (glibc; engines on CPU devices). XLA's CPU client allocates a step's buffers with
malloc. By default glibc gives the free memory at the top of a heap back to the kernel once it exceeds a trim
threshold, and serves large blocks by mmap, so the next step's buffers are fresh pages again, each one faulted in
and zeroed by the kernel: ~500 minor faults a step of a lone request on the 1B-class Q4_K model (the head's
logits, the quantized products' padding-row outputs: `jaxpaged bench step_parts`), none with the settings here.
`keep_freed_memory` sets glibc's trim threshold to 1 GiB and its mmap threshold to its largest, 32 MiB (blocks
above it, a model's weights, are still mapped on their own). It is process-wide: the process keeps the memory
of its busiest step instead of returning it between steps."""
from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
TRIM, MMAP = 1 << 30, 32 << 20  # bytes; MMAP: glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's trim and mmap thresholds (once a process) -> whether it took both (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_TRIM_THRESHOLD, TRIM) == 1 and mallopt(M_MMAP_THRESHOLD, MMAP) == 1
