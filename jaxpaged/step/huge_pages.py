"""The weights on transparent huge pages (Linux, CPU devices): the runner's parameters are read once per step from
memory, page after page; on 4 KiB pages every page is a TLB miss and a new start for the hardware prefetcher, so a
lone request's step runs below the machine's read rate. Where THP is on `madvise` (a common default), memory that
XLA allocates is on 4 KiB pages: `collapse` asks the kernel to back each weight buffer's whole 2 MiB spans with
huge pages now (madvise MADV_COLLAPSE, Linux 6.1+; the contents stay as they are). It is advice: a kernel that
declines (THP `never`, no free huge page, an older kernel) leaves the buffer as it was, and the step is the same.
The runner collapses the weights once, at placement, where the step's products run on the CPU kernels (quantized or
bfloat16): one row through a 1B-class body's packed Q4_K / Q4_0 stacks measured 15-20 % less time on them; its
bfloat16 tiles (2.1 GB) 20 % less CPU time a byte on the kernel's lone-row path (one thread), and a lone request's
replayed step 7 % less CPU time (median of 30 interleaved pairs, against the same weights as XLA placed them, 8 % of
them on huge pages then). Weights swapped in later (update_weights) stay as XLA allocates them, for the collapse
copies (~3 s a GB: 7 s for those 2.1 GB on a shared machine)."""
from __future__ import annotations

import ctypes
import functools
import sys

import jax

HUGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
MADV_COLLAPSE = 25  # <linux/mman.h>


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def spans(pointer: int, nbytes: int) -> tuple[int, int]:
    """The huge-page-aligned [start, end) inside the buffer at `pointer` of `nbytes` (empty: start == end)."""
    start, end = -(-pointer // HUGE) * HUGE, (pointer + nbytes) // HUGE * HUGE
    return (start, end) if end > start else (start, start)


def collapse(arrays) -> int:
    """Back the CPU buffers of `arrays` (jax.Arrays, each shard on a CPU device; others skipped) with huge pages,
    each buffer's whole 2 MiB spans only. -> the bytes the kernel collapsed (0 where it declines, or off Linux)."""
    madvise = _madvise()
    done = 0
    for i, a in enumerate(arrays):
        if not isinstance(a, jax.Array):
            raise ValueError(f"collapse: arrays[{i}] must be a jax.Array, got {type(a).__name__}")
        if madvise is None or a.is_deleted():
            continue
        for shard in a.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            shard.data.block_until_ready()  # written before its pages move
            start, end = spans(shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
            if end > start and madvise(start, end - start, MADV_COLLAPSE) == 0:
                done += end - start
    return done
