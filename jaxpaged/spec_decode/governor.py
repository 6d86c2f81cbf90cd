"""Whether speculation pays, measured: time per output token of steps with and without proposals, per
batch-size bucket (powers of two). Where proposing is slower, the engine stops proposing at that batch
size, and probes it again now and then (the workload may change): after PROBE_EVERY steps, and each probe
that confirms the choice doubles the wait (up to MAX_PROBE_EVERY), so a losing choice costs ever less."""
from __future__ import annotations

WARMUP = 3       # steps measured each way before deciding
PROBE_EVERY = 32  # then one step in PROBE_EVERY runs the choice not taken, to keep both figures fresh
MAX_PROBE_EVERY = 1024
ALPHA = 0.2      # weight of a new measurement in the running averages


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
        """A decode step of `batch_size` requests that took `seconds` (proposing included) for its tokens."""
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
