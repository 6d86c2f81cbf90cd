"""Invalidating the KV cache: what the pool holds stops counting (new weights or adapter, sleep, a step that
lost the pool). The one place that says what that takes."""
from __future__ import annotations

import jax


def invalidate_kv(runner, scheduler, only_if_lost: bool = False) -> bool:
    """Rebuild (zeroed) the pools a failed donated call deleted or poisoned, send every running request back
    to recompute from its first token (as after preemption) and drop the prefix cache. Intact pools are kept
    (a block is written again before it is read), and so are pools released by sleep (wake_up rebuilds them).
    only_if_lost (a failed step): only when a pool was lost. Returns whether the KV cache was invalidated."""
    on_device = all(isinstance(a, jax.Array) for a in jax.tree.leaves((runner.k_pool, runner.v_pool)))
    lost = on_device and runner.reset_pools(only_lost=True)
    if only_if_lost and not lost:
        return False
    scheduler.recompute_all()
    scheduler.bm.reset_prefix_cache()
    return True
