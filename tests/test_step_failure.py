"""A step that raises fails only its own requests: their blocks are freed, a consumed (donated) KV pool is
rebuilt, the other requests are recomputed and finish with the tokens they would have had, and the
engine keeps serving. Through the server: a 500 with an error id, siblings aborted, metrics counted,
/health down only after `max_step_failures` failed steps in a row."""
import asyncio
import itertools

import httpx
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncEngine
from jaxpaged.engine import EngineConfig, LLMEngine
from serve.app import create_app

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts():
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, 256, size=33)]  # two full blocks for the prefix cache
    return [shared + [int(t) for t in rng.integers(3, 256, size=n)] for n in (1, 7)] + \
        [[int(t) for t in rng.integers(3, 256, size=n)] for n in (3, 12, 20, 5)]


@pytest.fixture(scope="module")
def baseline(tiny_models, engine_kwargs):
    outs = LLM(model=tiny_models["llama"], **engine_kwargs).generate(_prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def engine(tiny_models, engine_kwargs):
    return LLMEngine(EngineConfig(model=tiny_models["llama"], **engine_kwargs))


def inject(engine, *, at_call: int, consume_pool: bool, times: int = 1) -> dict:
    """Make runner.execute raise on calls at_call .. at_call+times-1 (deleting the pool, as a failed
    donated call does, if consume_pool). Returns a record of the requests in the failed steps."""
    real, seen = engine.runner.execute, {"calls": 0, "failed": set(), "running": set()}

    def execute(out):
        seen["calls"] += 1
        if at_call <= seen["calls"] < at_call + times:
            seen["failed"] |= {r.group_id for r, _ in out.scheduled}
            seen["running"] |= {r.group_id for r in engine.scheduler.running}
            if consume_pool:
                engine.runner.k_pool.delete()
                engine.runner.v_pool.delete()
            raise RuntimeError("injected failure")
        return real(out)
    engine.runner.execute = execute
    return seen


def run(engine, ids_prompts, small_budget_at: int | None = None) -> dict:
    """Run to the end; step number `small_budget_at` gets a token budget of 2, so some running requests
    sit it out (a forced path, as in test_engine_paths)."""
    for rid, p in ids_prompts:
        engine.add_request(rid, {"prompt_token_ids": p}, GREEDY)
    done, budget = {}, engine.scheduler.max_num_batched_tokens
    for step in itertools.count(1):
        if not engine.has_unfinished_requests():
            return done
        engine.scheduler.max_num_batched_tokens = 2 if step == small_budget_at else budget
        try:
            outs = engine.step()
        finally:
            engine.scheduler.max_num_batched_tokens = budget
        done.update((o.request_id, o) for o in outs if o.finished)


def assert_all_free(engine):
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == s["num_waiting"] == 0
    assert all(c == 0 for c in engine.block_manager.ref_count)


@pytest.mark.parametrize("consume_pool", [False, True])
def test_failed_step_fails_only_its_requests(engine, baseline, consume_pool):
    prompts = _prompts()
    run(engine, [(f"warm{i}", p) for i, p in enumerate(prompts[:2])])  # fill the prefix cache
    preemptions = engine.stats()["num_preemptions"]
    seen = inject(engine, at_call=4, consume_pool=consume_pool)
    try:
        done = run(engine, [(str(i), p) for i, p in enumerate(prompts)], small_budget_at=4)
    finally:
        del engine.runner.execute
    failed = seen["failed"]
    assert failed and len(failed) < len(prompts) and len(done) == len(prompts)
    for i, toks in enumerate(baseline):
        o = done[str(i)]
        if str(i) in failed:
            assert o.outputs[0].finish_reason == "error" and "error id" in o.error
        else:
            assert o.error is None and o.outputs[0].token_ids == toks, i
    assert engine.stats()["num_step_failures"] >= 1 and engine.num_consecutive_step_failures == 0
    recomputed = seen["running"] - failed
    if consume_pool:  # the others' K/V went with the pool: recomputed, and the prefix cache dropped
        assert not engine.runner.k_pool.is_deleted() and recomputed
        assert engine.stats()["num_preemptions"] >= preemptions + len(recomputed)
    assert_all_free(engine)
    later = run(engine, [(f"later{i}", p) for i, p in enumerate(prompts)])  # prefix hits on rebuilt blocks
    assert [later[f"later{i}"].outputs[0].token_ids for i in range(len(prompts))] == baseline
    assert_all_free(engine)


def test_server_500_siblings_aborted_health(engine, baseline):
    """In-process app: a failed step is a 500 naming an error id; the job's other prompt is aborted; the
    metrics count it; the engine serves the next request; 3 failed steps in a row take /health down."""
    prompts, budget = _prompts(), engine.scheduler.max_num_batched_tokens

    async def main():
        aeng = AsyncEngine(engine, max_step_failures=3)
        app = create_app(aeng, served_model_name="tiny", shutdown_engine=False)
        transport = httpx.ASGITransport(app=app)
        body = dict(max_tokens=12, temperature=0, ignore_eos=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            engine.scheduler.max_num_batched_tokens = 4  # the second prompt waits for the first's chunks
            seen = inject(engine, at_call=1, consume_pool=True)  # the first prompt's first chunk
            r = await c.post("/v1/completions", json={"prompt": prompts[3:5], **body})
            engine.scheduler.max_num_batched_tokens = budget
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "step_failed" and "error id" in err["message"]
            assert len(seen["failed"]) == 1  # budget 4: the sibling was not in the failed step
            assert (await c.get("/health")).status_code == 200
            await asyncio.sleep(0.2)
            assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
            m = (await c.get("/metrics")).text
            assert 'finished_reason="error",model_name="tiny"} 1.0' in m
            assert 'finished_reason="abort",model_name="tiny"} 1.0' in m
            assert "jaxpaged:num_step_failures_total" in m
            r = await c.post("/v1/completions", json={"prompt": prompts[0], **body})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
            assert r.json()["choices"][0]["finish_reason"] == "length"
            del engine.runner.execute
            inject(engine, at_call=1, consume_pool=False, times=3)
            for i in range(3):
                r = await c.post("/v1/completions", json={"prompt": prompts[1], **body})
                assert r.status_code in (500, 503), r.text
            await asyncio.sleep(0.2)
            assert (await c.get("/health")).status_code == 503
            r = await c.post("/v1/completions", json={"prompt": prompts[1], **body})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        del engine.runner.execute
        aeng.shutdown()

    asyncio.run(main())
    assert_all_free(engine)
