"""Whether speculation pays, measured, at two grains.

- `Governor`, per token bucket: what a decode step costs (running averages of its time, proposing
  included). Proposals that fit the padding of the bucket a step of decodes takes anyway cost little, and
  the engine always makes them (decoder.py); more of them push the step into a larger bucket, which pays
  only if the tokens they are expected to add outweigh the larger step's time: a step of n decodes in
  bucket T yields n tokens in time(T); with proposals expected to add E accepted tokens in bucket T' it
  yields n + E in time(T'); so the larger bucket would pay when E > n * (time(T') / time(T) - 1). It is
  taken only when E exceeds that MARGIN times: accepted tokens shorten only the requests that accept, and
  where a batch waits for its slowest member (static batches, a client waiting for all its choices) a
  step whose tokens went to the fast ones saved nothing (measured: free text at batch 16, 32 requests,
  crossing at E > 1x the bound took 1.11x the plain time). The larger buckets are tried from the largest
  down, each with the proposals that fit it (those expected to keep most first). E comes from the
  requests' own acceptance (below). Before deciding, the governor measures each bucket a few times: T
  first (steps without the larger bucket), then T'.
- `RequestGate`, per request: how many proposals its own recent acceptance is worth, and how many of
  them it is expected to have accepted. A proposal the target rejects costs a row of the step (and may
  push the step into a larger token bucket) for nothing, so a request proposes about one more token than it
  has lately had accepted (a running average), and one whose whole proposal was rejected skips proposing
  for 1, 2, 4, ... steps (up to MAX_SKIP) until one is accepted again. Text that copies its prompt keeps
  proposing k; free text proposes little.
"""
from __future__ import annotations

WARMUP = 3        # steps measured in a bucket before its time is used
MARGIN = 2.0      # the expected tokens must pay for the larger step this many times over (see below)
ALPHA = 0.2       # weight of a new measurement in the running averages
GATE_ALPHA = 0.5  # weight of a request's newest acceptance count in its running average
MAX_SKIP = 16     # the longest a request whose proposals were all rejected waits before proposing again


class Governor:
    def __init__(self):
        self._times: dict[int, list] = {}  # token bucket -> [running average of a decode step's seconds, steps]

    def allow_larger(self, num_decodes: int, bucket: int, larger: int, expected: float) -> bool:
        """Whether a step of `num_decodes` decodes, in token bucket `bucket` without proposals beyond its
        padding, should take bucket `larger` for proposals expected to add `expected` accepted tokens."""
        base, big = self._times.get(bucket), self._times.get(larger)
        if base is None or base[1] < WARMUP:
            return False  # the step without them is measured first
        if big is None or big[1] < WARMUP:
            return True   # then the larger one
        return expected > MARGIN * num_decodes * (big[0] / base[0] - 1)

    def record(self, bucket: int, seconds: float) -> None:
        """A decode step (no prefill chunk) in token bucket `bucket` took `seconds`, proposing included."""
        st = self._times.setdefault(bucket, [seconds, 0])
        st[0] = seconds if st[1] == 0 else (1 - ALPHA) * st[0] + ALPHA * seconds
        st[1] += 1

    def summary(self) -> dict:
        """token bucket -> {step_seconds, steps}: the running average of a decode step's time there."""
        return {b: dict(step_seconds=st[0], steps=st[1]) for b, st in sorted(self._times.items())}


class RequestGate:
    def __init__(self, k: int):
        self.k = k
        self._state: dict[str, list] = {}  # request id -> [mean accepted, steps left to skip, last skip]

    def proposals(self, request_id: str, k: int) -> int:
        """How many of the (at most k) proposals request `request_id` should make this step (0: skip)."""
        st = self._state.get(request_id)
        if st is None:
            return k
        if st[1] > 0:
            st[1] -= 1
            return 0
        return max(1, min(k, int(st[0] + 0.5) + 1))

    def expected(self, request_id: str, k: int) -> float:
        """How many of k proposals the request is expected to have accepted (its running average; k when
        nothing is known yet)."""
        st = self._state.get(request_id)
        return float(k) if st is None else min(float(k), st[0])

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verified step in which the request proposed `num_proposed` tokens and the target kept
        `num_accepted` of them."""
        if num_proposed <= 0:
            return
        st = self._state.setdefault(request_id, [float(self.k), 0, 0])
        st[0] = (1 - GATE_ALPHA) * st[0] + GATE_ALPHA * num_accepted
        if num_accepted == 0:
            st[2] = min(max(1, 2 * st[2]), MAX_SKIP)
            st[1] = st[2]
        else:
            st[2] = 0

    def retain(self, request_ids: set) -> None:
        """Forget requests no longer running."""
        for rid in [r for r in self._state if r not in request_ids]:
            del self._state[rid]
