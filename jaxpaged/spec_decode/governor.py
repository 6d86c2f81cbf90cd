"""Whether speculation pays, measured, at two grains.

- `Governor`, per batch-size bucket (powers of two): time per output token of decode steps whose
  proposals pushed the step into a larger token bucket than its decodes alone take, and of steps that
  stayed in it (with no proposals, or only as many as the bucket's padding holds: those the engine always
  makes, decoder.py). Where the larger bucket is slower per token, the engine keeps proposals within the
  padding at that batch size, and probes the larger bucket again now and then (the workload may change):
  after PROBE_EVERY steps, and each probe that confirms the choice doubles the wait (up to
  MAX_PROBE_EVERY), so a losing choice costs ever less.
- `RequestGate`, per request: how many proposals its own recent acceptance is worth. A proposal the target
  rejects costs a row of the step (and may push the step into a larger token bucket) for nothing, so a
  request proposes about one more token than it has lately had accepted (a running average), and one whose
  whole proposal was rejected skips proposing for 1, 2, 4, ... steps (up to MAX_SKIP) until one is accepted
  again. Text that copies its prompt keeps proposing k; free text proposes little.
"""
from __future__ import annotations

WARMUP = 3       # steps measured each way before deciding
PROBE_EVERY = 32  # then one step in PROBE_EVERY runs the choice not taken, to keep both figures fresh
MAX_PROBE_EVERY = 1024
ALPHA = 0.2      # weight of a new measurement in the running averages
GATE_ALPHA = 0.5  # weight of a request's newest acceptance count in its running average
MAX_SKIP = 16     # the longest a request whose proposals were all rejected waits before proposing again


class Governor:
    def __init__(self):
        # bucket -> [tpot with, tpot without, n with, n without, steps to the next probe, probe interval,
        #            choice when the last probe was set]
        self._stats: dict[int, list] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def _bucket_stats(self, batch_size: int) -> list:
        return self._stats.setdefault(self.bucket(batch_size), [0.0, 0.0, 0, 0, PROBE_EVERY, PROBE_EVERY, None])

    def should_propose(self, batch_size: int) -> bool:
        """Whether this step's proposals may take a larger token bucket than its decodes alone."""
        st = self._bucket_stats(batch_size)
        if st[3] < WARMUP:
            return False
        if st[2] < WARMUP:
            return True
        choice = st[0] < st[1]
        if choice != st[6]:                         # the choice changed: probe soon again
            st[4] = st[5] = PROBE_EVERY
            st[6] = choice
        st[4] -= 1
        if st[4] > 0:
            return choice
        st[5] = min(2 * st[5], MAX_PROBE_EVERY)     # if this probe confirms the choice, wait twice as long
        st[4] = st[5]
        return not choice

    def record(self, batch_size: int, proposed: bool, seconds: float, num_output_tokens: int) -> None:
        """A decode step of `batch_size` requests that took `seconds` (proposing included) for its tokens;
        proposed: its proposals took a larger token bucket than its decodes alone."""
        if num_output_tokens <= 0:
            return
        st = self._bucket_stats(batch_size)
        i = 0 if proposed else 1
        tpot = seconds / num_output_tokens
        st[i] = tpot if st[2 + i] == 0 else (1 - ALPHA) * st[i] + ALPHA * tpot
        st[2 + i] += 1

    def summary(self) -> dict:
        """bucket -> {tpot_with, tpot_without, proposing}: the current figures and decision."""
        return {b: dict(tpot_with=st[0] if st[2] else None, tpot_without=st[1] if st[3] else None,
                        proposing=bool(st[3] >= WARMUP and (st[2] < WARMUP or st[0] < st[1])))
                for b, st in sorted(self._stats.items())}


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
