"""Per-step counts the server publishes as histograms (host code, no numpy needed).

`IterationTokens` counts the tokens each engine step processed (prefill chunks, decodes and proposals
together) into vLLM's buckets for `iteration_tokens_total`; the server reads `snapshot()` at scrape time.
"""
from __future__ import annotations

import bisect

ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """A histogram of tokens per step: counts per bucket (non-cumulative, the last one is +Inf) and a sum."""

    def __init__(self, buckets=ITERATION_TOKENS_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, num_tokens)] += 1
        self.sum += num_tokens

    def snapshot(self) -> dict:
        """{"buckets": upper bounds, "counts": per bucket then +Inf, "sum": tokens}, copies."""
        return dict(buckets=self.buckets, counts=list(self.counts), sum=self.sum)
