"""The persistent batch, updated by difference over a long random workload, equals a batch rebuilt from
scratch every step, and its token arrays equal a plain per-token construction."""
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.core.batch import NUM_BANNED, PersistentBatch, layout, pack
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Request
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.step_result import Sampled, StepResult


def _params(rnd: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=rnd.randint(3, 12), temperature=rnd.choice([0.0, 0.7, 1.3]), top_p=rnd.choice([1.0, 0.8]),
        top_k=rnd.choice([0, 5]), min_p=rnd.choice([0.0, 0.1]), min_tokens=rnd.choice([0, 0, 3]),
        repetition_penalty=rnd.choice([1.0, 1.0, 1.2]), presence_penalty=rnd.choice([0.0, 0.5]),
        stop_token_ids=rnd.sample(range(3, 30), rnd.randint(0, NUM_BANNED + 2)), ignore_eos=rnd.random() < 0.5,
        logprobs=rnd.choice([None, 2]))


def _plain_tokens(scheduled, T, bs):
    """input_ids / positions / slot_mapping the obvious way: a Python loop over every token."""
    ids, pos, sm = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
    t = 0
    for req, n in scheduled:
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            ids[t], pos[t], sm[t] = req.token_ids[p], p, req.block_ids[p // bs] * bs + p % bs
            t += 1
    return ids, pos, sm


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_persistent_batch_equals_rebuilt(data):
    bs = data.draw(st.sampled_from([1, 4, 16]))
    S, M = data.draw(st.integers(1, 6)), 64
    num_blocks = data.draw(st.integers(2 + 64 // bs, 42 + 64 // bs))
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=data.draw(st.booleans()))
    sched = Scheduler(bm, max_num_seqs=S, max_num_batched_tokens=data.draw(st.integers(1, 40)))
    rnd = random.Random(data.draw(st.integers(0, 2 ** 16)))
    persistent = PersistentBatch(S, -(-M // bs), M, bs)
    live, next_id = [], 0
    for _ in range(data.draw(st.integers(20, 120))):
        if rnd.random() < 0.3 and next_id < 40:
            params = _params(rnd)
            prompt = [rnd.randint(3, 6) for _ in range(rnd.randint(1, M - params.max_tokens))]
            req = Request(request_id=f"r{next_id}", group_id=f"r{next_id}", index=0, prompt_token_ids=prompt,
                          params=params, seed=rnd.randrange(2 ** 32), eos_token_ids=frozenset({2}))
            sched.add(req)
            live.append(req)
            next_id += 1
        if live and rnd.random() < 0.05:
            sched.abort(live.pop(rnd.randrange(len(live))))
        out = sched.schedule()
        if out.is_empty:
            continue
        T = out.num_tokens + rnd.choice([0, 1, 5, 64])  # a bucket: fewer rows than slots, or more
        got_b, got_s = persistent.prepare(out.scheduled, T)
        want_b, want_s = PersistentBatch(S, -(-M // bs), M, bs).prepare(out.scheduled, T)
        slots = [r.slot for r, _ in out.scheduled]
        assert got_b["sample_slots"].tolist() == slots + [S] * (min(S, T) - len(slots))  # R = min(S, T) rows
        for name, a in want_b.items():
            if name == "block_tables":
                for r, _ in out.scheduled:
                    n = len(r.block_ids)
                    assert got_b[name][r.slot, :n].tolist() == r.block_ids == a[r.slot, :n].tolist()
            else:
                assert np.array_equal(got_b[name], a), name
        for name, a in want_s.items():
            a, b = np.asarray(a), np.asarray(got_s[name])
            assert np.array_equal(b[slots] if a.ndim else b, a[slots] if a.ndim else a), name
        for r, _ in out.scheduled:  # penalties: the history row holds the request's tokens
            if r.params.uses_penalties:
                h = len(r.token_ids)
                assert persistent.history[r.slot, :h].tolist() == r.token_ids
        ids, pos, sm = _plain_tokens(out.scheduled, T, bs)
        for name, plain in (("input_ids", ids), ("positions", pos), ("slot_mapping", sm)):
            assert np.array_equal(got_b[name], plain), name
        assert layout(got_b, got_s) == layout(want_b, want_s)  # one layout per bucket
        lay, buf = layout(got_b, got_s), pack(got_b, got_s)
        for which, name, shape, dtype, start, size in lay:  # the buffer holds every array, bit for bit
            a = np.asarray((got_b, got_s)[which][name])
            want = a.astype(np.int32) if dtype == "bool" else a.reshape(-1).view(np.int32)
            assert np.array_equal(buf[start:start + size], want.reshape(-1)), name
        sampled = StepResult({r.slot: Sampled([rnd.randint(2, 6)], None) for r, _ in out.scheduled})
        for req in sched.update_from_output(out, sampled):
            if req.num_output_tokens >= req.params.max_tokens or req.token_ids[-1] == 2:
                sched.finish(req, "stop")
                live.remove(req)
    for req in list(live):
        sched.abort(req)
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_pack_same_for_decoded_arrays():
    """A multi-host follower gets every input back as an ndarray (flags as 0-d arrays): same buffer."""
    batch, sp = PersistentBatch(3, 4, 8, 4).prepare([], 8)
    decoded = [{k: np.array(v) for k, v in d.items()} for d in (batch, sp)]
    assert isinstance(sp["all_greedy"], np.bool_) and decoded[1]["all_greedy"].shape == ()
    assert layout(batch, sp) == layout(*decoded)
    assert np.array_equal(pack(batch, sp), pack(*decoded))
