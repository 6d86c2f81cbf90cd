"""The host heap's settings for a CPU step: XLA's temporaries reused from step to step, not faulted in anew.

XLA's CPU client allocates a compiled step's temporaries as one block per call (`posix_memalign` on one of
its worker threads; ~90 MB for the default model's step at 64 running) and frees it when the call ends.
With glibc's defaults a block that size is always mapped fresh: a worker thread's arena cannot hold a block
over 64 MB, so it goes to `mmap`, and `munmap` on free. Every page the step then writes (the lm_head's
logits f32[64, 49152]: ~3,300 pages) is a page fault that zeroes it: ~12 ms of CPU time a step there
(`jaxpaged bench step_parts`, "page faults"). `keep_step_arena` has glibc serve every thread from the
main heap (one arena), never `mmap` a block, and keep up to `TRIM_BYTES` of free memory at the heap's top,
so the next step's block is the same memory, already mapped.

It must run before XLA's CPU client starts its threads (each keeps the arena it first allocated from, at
its start): `EngineConfig` calls it before it first asks JAX for its backend. In a process that started JAX
earlier the settings still apply to the main heap, and the worker threads' blocks stay mapped fresh.
The heap keeps what it frees: `release_host_memory` (glibc's `malloc_trim`) hands it back on request.
A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_BYTES = 1 << 30  # free memory kept at the heap's top: above any step's temporaries at the benches' sizes


def keep_step_arena() -> bool:
    """Set glibc's heap so that a step's temporaries are reused (module docstring). True when set, False
    where there is no glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(p, v) == 1 for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_BYTES)))
