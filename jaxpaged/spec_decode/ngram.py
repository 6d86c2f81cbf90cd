"""The n-gram proposer (prompt lookup): host only, numpy, no jax.

For the longest n in [prompt_lookup_min, prompt_lookup_max] whose last n tokens of the request occurred
earlier in its own tokens (prompt + output), propose the k tokens that followed the most recent such
occurrence. Text that copies spans of its input (rewriting, fixing, continuing a shipped text) gets long
runs of accepted proposals; free text mostly finds no match and proposes nothing.
"""
from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to k proposed token ids i32[<=k] for the continuation of `tokens` i32[L] (empty: no match).

    Vectorized: the candidate ends are the earlier positions holding the last token; each n filters them
    by one more column of the suffix."""
    L = tokens.shape[0]
    if k < 1 or L < n_min + 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # [C] candidate match ends (a token follows)
    best = int(ends[-1]) if n_min <= 1 and ends.size else -1  # a match of the last token alone (n = 1)
    for j in range(1, min(n_max, L - 1)):       # grow the suffix one token to the left at a time
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[L - 1 - j]]  # the suffix of length j + 1 still matches
        if ends.size == 0:
            break
        if j + 1 >= n_min:
            best = int(ends[-1])                 # the most recent match of the longest suffix so far
    if best < 0:
        return tokens[:0]
    return tokens[best + 1:best + 1 + k]


class NgramProposer:
    """Proposals for running requests from their own tokens; a numpy copy of each request's tokens is
    kept and extended by difference (a step costs O(new tokens + matches), not O(length))."""

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._buf: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (i32[capacity], length)

    def _tokens(self, req) -> np.ndarray:
        buf, n = self._buf.get(req.request_id, (None, 0))
        L = len(req.token_ids)
        if buf is None or n > L or buf.shape[0] < L:  # new, truncated, or grown past its capacity
            cap = max(64, 2 * L)
            new = np.empty(cap, np.int32)
            keep = min(n, L) if buf is not None else 0
            if keep:
                new[:keep] = buf[:keep]
            buf, n = new, keep
        if L > n:
            buf[n:L] = req.token_ids[n:L]
        self._buf[req.request_id] = (buf, L)
        return buf[:L]

    def propose(self, req, k: int) -> list[int]:
        """At most k proposals for the request's next tokens (it is decoding: all its tokens are known)."""
        return ngram_propose(self._tokens(req), min(k, self.k), self.n_min, self.n_max).tolist()

    def retain(self, request_ids: set) -> None:
        """Drop the copies of requests not in `request_ids` (finished, aborted, preempted)."""
        for rid in [r for r in self._buf if r not in request_ids]:
            del self._buf[rid]
