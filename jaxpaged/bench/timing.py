"""The benchmarks' one timer: seconds per call of a function called again and again, its results waited for.

Spans of a whole run (an engine draining its requests, a compile, a time budget) are read off
`time.perf_counter()` where they happen; what is timed by repetition goes through `samples`.
"""
from __future__ import annotations

import time


def samples(fn, *args, reps: int = 5, calls: int = 1, warmup: int = 1) -> list[float]:
    """Seconds per call of fn(*args): `reps` samples, after `warmup` untimed calls (compilation, first touch).

    A sample is `calls` back-to-back calls, then a wait for the last one's result (JAX dispatches
    asynchronously: `jax.block_until_ready`, which returns at once for anything that is not a JAX array),
    divided by `calls`; several calls per sample time a pipelined stream, one call its latency."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        out.append((time.perf_counter() - t) / calls)
    return out
