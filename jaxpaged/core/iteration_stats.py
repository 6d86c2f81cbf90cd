"""Per-step counts the server publishes as histograms (host code, no numpy needed).

`IterationTokens` counts the tokens of each engine step that gave requests tokens, as vLLM 0.32 counts them
for `iteration_tokens_total` (`loggers.py`: a step's new output tokens, plus the computed prompt tokens of the
requests whose first token it made, counted once, when their prefill ends), into vLLM's buckets; the output
processor observes them (core/output_processor.py), the server reads `snapshot()` at scrape time. A step
that only prefills chunks of a longer prompt gives no token, so it is not counted (as vLLM's).
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
