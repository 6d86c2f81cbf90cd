"""Pause / resume in each mode, sleep / wake at each level: afterwards generation equals the output of the
engine before any of it (seeded sampling and greedy), and no step is recompiled."""
import asyncio

import jax
import numpy as np
import pytest
from starlette.testclient import TestClient

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncEngine

PROMPTS = [{"prompt_token_ids": [3 + i, 17, 9 + 2 * i, 44, 101 - i] * (1 + i)} for i in range(4)]
SAMPLED = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=100 + i, ignore_eos=True)
           for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def llm(request, tiny_models, engine_kwargs):
    return LLM(model=tiny_models["llama"], async_scheduling=request.param, **engine_kwargs)


@pytest.fixture(scope="module")
def reference(llm):
    """Outputs of the engine before any pause or sleep."""
    return ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)],
            [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])


def _start(eng, params, steps=3, n=4):
    """Add the first n PROMPTS and run `steps` steps; returns their ids."""
    params = params if isinstance(params, list) else [params] * 4
    ids = [eng.add_request(None, p, sp) for p, sp in zip(PROMPTS[:n], params[:n])]
    for _ in range(steps):
        eng.step()
    return ids


def _finish(eng) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    return done


def _generated(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]


def test_pause_abort(llm, reference):
    eng = llm.engine
    ids = _start(eng, SAMPLED)
    outs = [o for o in llm.pause_generation("abort") if o.finished]  # async: the step in flight's too
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert llm.is_paused and not eng.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate(PROMPTS[:1], SAMPLED[0], use_tqdm=False)
    llm.resume_generation()
    assert _generated(llm) == reference[0]


def test_pause_wait_finishes_running_and_holds_the_rest(llm, reference):
    eng = llm.engine
    first = _start(eng, SAMPLED, steps=1, n=2)  # running at the pause
    late = [eng.add_request(None, PROMPTS[i], SAMPLED[i]) for i in (2, 3)]
    outs = {o.request_id: o.outputs[0].token_ids for o in llm.pause_generation("wait") if o.finished}
    assert sorted(outs) == sorted(first)
    assert [outs[i] for i in first] == reference[0][:2]
    assert all(eng.groups[i].samples[0].num_output_tokens == 0 for i in late)  # held while paused
    assert eng.step() == [] and not eng.can_step()
    llm.resume_generation()
    done = _finish(eng)
    assert [done[i] for i in late] == reference[0][2:]


def test_pause_keep_continues_with_same_seeds(llm, reference):
    eng = llm.engine
    ids = _start(eng, SAMPLED)
    outs = llm.pause_generation("keep")
    for _ in range(3):
        assert eng.step() == []
    assert all(not o.finished for o in outs)
    llm.resume_generation()
    done = _finish(eng)
    assert [done[i] for i in ids] == reference[0]


def test_pause_keep_update_weights_continues_under_new_weights(llm, reference):
    eng = llm.engine
    old = jax.tree.map(np.asarray, llm.get_weights())
    rng = np.random.default_rng(0)
    new = jax.tree.map(lambda a: (a + 0.05 * rng.standard_normal(a.shape)).astype(a.dtype), old)
    ids = _start(eng, GREEDY, steps=4)
    llm.pause_generation("keep")
    before = {i: eng.groups[i].samples[0].num_output_tokens for i in ids}
    assert all(before.values())
    compiled = llm.stats()["num_compilations"]
    llm.update_weights(new)
    llm.resume_generation()
    done = _finish(eng)
    fresh = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p["prompt_token_ids"] + ref[:before[i]]}
         for p, ref, i in zip(PROMPTS, reference[1], ids)],
        [SamplingParams(max_tokens=12 - before[i], temperature=0, ignore_eos=True) for i in ids], use_tqdm=False)]
    for i, ref, cont in zip(ids, reference[1], fresh):
        assert done[i][:before[i]] == ref[:before[i]]  # the old weights' tokens, kept
        assert done[i][before[i]:] == cont  # then the new weights', KV recomputed
    assert done[ids[0]] != reference[1][0] or done[ids[1]] != reference[1][1]  # the update took effect
    llm.update_weights(old)
    assert llm.stats()["num_compilations"] == compiled
    assert _generated(llm) == reference[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake(llm, reference, level):
    host = jax.tree.map(np.asarray, llm.get_weights())
    s = llm.stats()
    held = s["param_bytes_per_device"] + s["kv_bytes_per_device"]
    bytes_ = llm.sleep(level=level)
    assert bytes_["before"]["engine_bytes"] == held and bytes_["after"]["engine_bytes"] == 0
    assert bytes_["before"]["live_array_bytes"] - bytes_["after"]["live_array_bytes"] >= held
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS[:1], SAMPLED[0], use_tqdm=False)
    if level == 2:
        with pytest.raises(RuntimeError, match="update_weights"):
            llm.wake_up()
        llm.update_weights(host)  # the trainer's weights bring them back
    woken = llm.wake_up()
    assert woken["after"]["engine_bytes"] == held
    assert llm.stats()["num_compilations"] == s["num_compilations"]
    assert _generated(llm) == reference[0]
    if level == 2:
        llm.sleep(level=2)
        llm.wake_up(reload=True)  # from the model directory
        assert _generated(llm) == reference[0]


def test_sleep_while_paused_keeps_requests(llm, reference):
    eng = llm.engine
    ids = _start(eng, SAMPLED)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()
    llm.pause_generation("keep")
    llm.sleep(level=1)
    llm.wake_up()
    llm.resume_generation()
    done = _finish(eng)
    assert [done[i] for i in ids] == reference[0]


def test_bad_mode_and_level_name_the_argument(llm):
    with pytest.raises(ValueError, match="mode"):
        llm.pause_generation("later")
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    assert not llm.is_paused


def test_server_pause_resume(tiny_models, engine_kwargs):
    from serve.app import create_app
    eng = LLM(model=tiny_models["llama"], **engine_kwargs).engine
    reference = [[o.outputs[0].token_ids for o in LLM.from_engine(eng).generate(PROMPTS[:1], SAMPLED[0],
                                                                                use_tqdm=False)]]
    async_engine = AsyncEngine(eng)
    app = create_app(async_engine, served_model_name="tiny", shutdown_engine=False)
    try:
        with TestClient(app) as client:
            assert client.get("/is_paused").json() == {"is_paused": False}
            r = client.post("/pause?mode=sometime")
            assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
            assert client.post("/pause?mode=keep").json()["is_paused"] is True
            assert client.get("/is_paused").json() == {"is_paused": True}

            async def run():  # queued while paused, finished after resume
                task = asyncio.ensure_future(_collect(async_engine, PROMPTS[0], SAMPLED[0]))
                await asyncio.sleep(0.5)
                assert not task.done()
                await async_engine.resume_generation()
                return await task
            assert asyncio.run(run()) == reference[0][0]
            assert client.post("/resume").json() == {"is_paused": False}
    finally:
        async_engine.shutdown()


async def _collect(async_engine, prompt, params):
    last = None
    async for out in async_engine.generate(prompt, params, "srv"):
        last = out
    return last.outputs[0].token_ids
