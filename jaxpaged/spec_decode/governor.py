"""Whether speculation pays, measured: time per output token of steps with and without proposals, per
batch-size bucket (powers of two). Where proposing is slower, the engine stops proposing at that batch
size, and probes it again now and then (the workload may change)."""
from __future__ import annotations

WARMUP = 3       # steps measured each way before deciding
PROBE_EVERY = 32  # then one step in PROBE_EVERY runs the choice not taken, to keep both figures fresh
ALPHA = 0.2      # weight of a new measurement in the running averages


class Governor:
    def __init__(self):
        self._stats: dict[int, list] = {}  # bucket -> [tpot with, tpot without, n with, n without, steps]

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def should_propose(self, batch_size: int) -> bool:
        st = self._stats.setdefault(self.bucket(batch_size), [0.0, 0.0, 0, 0, 0])
        if st[3] < WARMUP:
            return False
        if st[2] < WARMUP:
            return True
        st[4] += 1
        choice = st[0] < st[1]
        return (not choice) if st[4] % PROBE_EVERY == 0 else choice

    def record(self, batch_size: int, proposed: bool, seconds: float, num_output_tokens: int) -> None:
        """A decode step of `batch_size` requests that took `seconds` (proposing included) for its tokens."""
        if num_output_tokens <= 0:
            return
        st = self._stats.setdefault(self.bucket(batch_size), [0.0, 0.0, 0, 0, 0])
        i = 0 if proposed else 1
        tpot = seconds / num_output_tokens
        st[i] = tpot if st[2 + i] == 0 else (1 - ALPHA) * st[i] + ALPHA * tpot
        st[2 + i] += 1

    def summary(self) -> dict:
        """bucket -> {tpot_with, tpot_without, proposing}: the current figures and decision."""
        return {b: dict(tpot_with=st[0] if st[2] else None, tpot_without=st[1] if st[3] else None,
                        proposing=bool(st[3] >= WARMUP and (st[2] < WARMUP or st[0] < st[1])))
                for b, st in sorted(self._stats.items())}
