"""AsyncEngine: the engine loop on its thread, outputs as asyncio streams, aborts, back-pressure, idleness."""
import asyncio
import os
import time

import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from jaxpaged.testing.tiny_models import make_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, engine_kwargs):
    path = make_tiny_model(str(tmp_path_factory.mktemp("async_model")), "llama")
    return LLMEngine(EngineConfig(model=path, **engine_kwargs))


@pytest.fixture
def aengine(engine):
    ae = AsyncEngine(engine, max_waiting=4)
    yield ae
    ae.shutdown()
    assert not engine.has_unfinished_requests()


def prompt(i, n=12):
    return [3 + (i * 7 + j) % 250 for j in range(n)]


def thread_cpu_seconds(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_generate_matches_engine_and_streams(engine, aengine):
    params = SamplingParams(max_tokens=20, **GREEDY)

    async def run():
        seen = []
        async for out in aengine.generate(prompt(0), params, "a"):
            seen.append(len(out.outputs[0].token_ids))
        return out, seen
    out, seen = asyncio.run(run())
    assert out.finished and out.outputs[0].finish_reason == "length" and seen == sorted(seen) and seen[-1] == 20
    engine_ids = None
    aengine.shutdown()  # the engine is the loop's alone while it runs: stop it, then compare directly
    engine.add_request("b", prompt(0), params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            engine_ids = o.outputs[0].token_ids
    assert out.outputs[0].token_ids == engine_ids


def test_many_concurrent_requests_and_n(aengine):
    async def one(i):
        params = SamplingParams(max_tokens=8 + i, n=1 + i % 2, temperature=1.0, seed=i, ignore_eos=True)
        stream = await aengine.add_request(f"r{i}", prompt(i), params)
        async for out in stream:
            pass
        return out
    aengine.max_waiting = None

    async def run():
        return await asyncio.gather(*[one(i) for i in range(12)])
    outs = asyncio.run(run())
    for i, out in enumerate(outs):
        assert out.finished and len(out.outputs) == 1 + i % 2
        assert all(len(c.token_ids) == 8 + i for c in out.outputs)
    assert aengine.stats()["kv_cache_usage"] == 0


def test_bad_request_raises_and_queues_nothing(aengine):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await aengine.add_request("x", prompt(0), SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="out of vocabulary"):
            await aengine.add_request("y", [999_999], SamplingParams())
    asyncio.run(run())
    s = aengine.stats()
    assert s["num_waiting"] == 0 and s["num_running"] == 0


def test_abort_and_early_exit_free_blocks(aengine):
    async def run():
        stream = await aengine.add_request("long", prompt(1, 40), SamplingParams(max_tokens=200, **GREEDY))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()  # leaving early aborts
        other = await aengine.add_request("other", prompt(2, 40), SamplingParams(max_tokens=200, **GREEDY))
        await anext(other)
        aengine.abort("other")  # an explicit abort ends the stream
        rest = [o async for o in other]
        return rest
    assert all(not o.finished for o in asyncio.run(run()))
    deadline = time.monotonic() + 5
    while aengine.stats()["kv_cache_usage"] > 0 or aengine.stats()["num_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_queue_full(aengine):
    async def run():
        streams, rejected = [], 0
        for i in range(30):
            try:
                streams.append(await aengine.add_request(f"q{i}", prompt(i), SamplingParams(max_tokens=50, **GREEDY)))
            except QueueFullError:
                rejected += 1
        for s in streams:
            async for _ in s:
                pass
        return len(streams), rejected
    accepted, rejected = asyncio.run(run())
    assert rejected > 0 and accepted >= 4


def test_idle_loop_sleeps_and_shutdown(aengine):
    async def run():
        async for _ in aengine.generate(prompt(3), SamplingParams(max_tokens=4), "warm"):
            pass
    asyncio.run(run())
    tid = aengine._thread.native_id
    c0 = thread_cpu_seconds(tid)
    time.sleep(1.0)
    assert thread_cpu_seconds(tid) - c0 < 0.02
    assert aengine.is_alive()
    aengine.shutdown()
    assert not aengine.is_alive()

    async def late():
        with pytest.raises(EngineDeadError):
            await aengine.add_request("late", prompt(0), SamplingParams())
    asyncio.run(late())
