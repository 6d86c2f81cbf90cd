"""Property-based tests of the host side: block manager and scheduler under random operations."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.step_result import Sampled, StepResult


def _check_invariants(bm: BlockManager, live: list[Request]):
    owners = {}
    for r in live:
        held = [b for b in r.block_ids if b]  # 0: dropped behind the sliding window
        assert len(set(held)) == len(held), "a request holds a block twice"
        assert bm.sliding_window or len(held) == len(r.block_ids), "null block handed out"
        for b in held:
            owners[b] = owners.get(b, 0) + 1
    for b in range(1, bm.num_blocks):
        assert bm.ref_count[b] == owners.get(b, 0), f"block {b}: ref count {bm.ref_count[b]} != owners"
    free = set(bm.free_blocks) | set(bm.evictable)
    assert len(free) == len(bm.free_blocks) + len(bm.evictable), "a block is free twice"
    assert not free & set(owners), "a block is both free and owned"
    assert free | set(owners) == set(range(1, bm.num_blocks)), "a block leaked"
    for key, b in bm.cache.items():
        assert bm.block_key[b] == key


def _req(i, tokens, max_tokens=8, n_index=0, sibling=None):
    return Request(request_id=f"r{i}", group_id=f"g{i}", index=n_index, prompt_token_ids=tokens,
                   params=SamplingParams(max_tokens=max_tokens), seed=i, sibling=sibling)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_scheduler_random_workload_no_leaks(data):
    num_blocks = data.draw(st.integers(8, 40))
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    window = data.draw(st.one_of(st.none(), st.integers(1, 12)))
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=data.draw(st.booleans()), sliding_window=window)
    sched = Scheduler(bm, max_num_seqs=data.draw(st.integers(1, 6)),
                      max_num_batched_tokens=data.draw(st.integers(1, 40)))
    rnd = random.Random(data.draw(st.integers(0, 2 ** 16)))
    vocab = data.draw(st.integers(2, 6))  # small vocab: many equal prefixes, many cache hits
    live, next_id = [], 0
    for _ in range(data.draw(st.integers(1, 60))):
        op = rnd.random()
        if op < 0.3:
            max_len = (num_blocks - 1) * bs  # every request fits the pool alone
            plen = rnd.randint(1, max(1, max_len // 2))
            r = _req(next_id, [rnd.randrange(vocab) for _ in range(plen)], rnd.randint(1, max_len - plen))
            next_id += 1
            sched.add(r)
            live.append(r)
        elif op < 0.4 and live:
            r = rnd.choice(live)
            sched.abort(r)
            live.remove(r)
        else:
            out = sched.schedule()
            assert out.num_tokens <= sched.max_num_batched_tokens
            slots = [r.slot for r, _ in out.scheduled]
            assert len(set(slots)) == len(slots) and slots == sorted(slots)
            for r, n in out.scheduled:
                assert r.status is RequestStatus.RUNNING and n >= 1
                assert len(r.block_ids) * bs >= r.num_computed_tokens + n
                lowest = max(r.num_computed_tokens - (window or 10 ** 9) + 1, 0)  # first key a query sees
                assert all(r.block_ids[j] for j in range(lowest // bs, -(-(r.num_computed_tokens + n) // bs)))
            sampled = StepResult({r.slot: Sampled([rnd.randrange(vocab)], None) for r, _ in out.scheduled})
            for r in sched.update_from_output(out, sampled):
                if r.num_output_tokens >= r.params.max_tokens:
                    sched.finish(r, "length")
                    live.remove(r)
        _check_invariants(bm, [r for r in live if r.status is RequestStatus.RUNNING])
        if window:  # a running request holds at most its window and a step's tokens (+ partial blocks)
            for r in sched.running:
                assert sum(1 for b in r.block_ids if b) <= bm.max_blocks_held(10 ** 9, sched.max_num_batched_tokens)
        assert len(sched.running) <= sched.max_num_seqs
    for r in list(live):
        sched.abort(r)
    _check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks - 1
    assert sorted(sched.free_slots) == list(range(sched.max_num_seqs))


def test_progress_without_deadlock():
    """Every request finishes even when the pool holds only one request at a time."""
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    reqs = [_req(i, list(range(i, i + 6)), max_tokens=10) for i in range(6)]
    for r in reqs:
        sched.add(r)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        for r in sched.update_from_output(out, StepResult({r.slot: Sampled([1], None) for r, _ in out.scheduled})):
            if r.num_output_tokens >= 10:
                sched.finish(r, "length")
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert bm.num_free_blocks == 4


def test_prefix_cache_lru_and_never_last_token():
    bm = BlockManager(6, 2)
    a = _req(0, [1, 2, 3, 4, 5])
    assert bm.match_prefix(a) == 0 and bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_blocks(a)
    assert len(bm.cache) == 2  # two full blocks; the partial third is not cached
    bm.free(a)
    b = _req(1, [1, 2, 3, 4])  # full match would cover the last token: only one block may hit
    assert bm.match_prefix(b) == 2
    c = _req(2, [1, 2, 3, 4, 9])
    assert bm.match_prefix(c) == 4
    assert bm.prefix_cache_hit_rate > 0
    bm.free(b), bm.free(c)
    # filling the pool evicts the cached blocks, least recently freed first
    d = _req(3, [7] * 10)
    assert bm.allocate(d, 10) and not bm.cache


def test_sliding_window_frees_blocks_behind_it():
    """Blocks whose positions every future query's window has passed go back to the pool; cached ones
    stay cached (evictable) and still serve prefix hits; the null block takes their place."""
    bs, w = 4, 6
    bm = BlockManager(32, bs, enable_prefix_caching=True, sliding_window=w)
    a = _req(0, list(range(3, 23)))  # 20 tokens: 5 blocks
    assert bm.allocate(a, 20)
    a.num_computed_tokens = 20
    bm.cache_blocks(a)
    held = list(a.block_ids)
    assert bm.allocate(a, 21)  # next query at 20 sees keys 15..20: blocks 0..2 (positions 0..11) are dead
    assert a.block_ids[:3] == [0, 0, 0] and a.block_ids[3:5] == held[3:5] and len(a.block_ids) == 6
    assert all(b in bm.evictable for b in held[:3])  # cached: evictable, not lost
    b = _req(1, list(range(3, 23)) + [99])
    assert bm.match_prefix(b) == 20  # the dropped blocks still serve a prefix hit
    bm.free(a)
    bm.free(b)
    _check_invariants(bm, [])
    assert bm.num_free_blocks == 31


def test_waiting_deferred_by_the_lora_budget():
    """Waiting requests whose adapter would exceed max_loras are 'deferred' (vLLM's waiting reason), the rest
    wait for capacity; once the running adapter's requests leave, none is deferred."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_loras=1)
    reqs = [_req(i, list(range(1, 6))) for i in range(4)]
    for r, lora in zip(reqs, (1, 2, 1, 0)):
        r.lora_int_id = lora
        sched.add(r)
    assert sched.num_deferred() == 0           # nothing runs yet: every adapter fits
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0"]  # r1's adapter 2 does not fit beside 1
    assert sched.num_deferred() == 1           # r1 (adapter 2); r2 (adapter 1) and r3 (base) wait for capacity
    for r, _ in out.scheduled:
        sched.finish(r, "length")
    assert sched.num_deferred() == 0
