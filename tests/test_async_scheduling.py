"""Async scheduling gives exactly the synchronous engine's outputs, on every forced path.

One workload mixes greedy and seeded sampling, stop ids, stop strings, min_tokens, penalties, logprobs
and n > 1, over shared prefixes; it runs synchronously and asynchronously on a roomy engine and on one
forced into preemption and chunked prefill, twice each (the second run hits the prefix cache), with
some requests aborted in flight. Everything a caller sees must be equal.
"""
import numpy as np
import pytest

from jaxpaged import EngineConfig, SamplingParams
from jaxpaged.engine import LLMEngine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model
    path = make_tiny_model(str(tmp_path_factory.mktemp("async") / "tiny"), "llama", vocab_size=320)
    add_tiny_tokenizer(path, vocab_size=300)
    return path


def _workload():
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, 300, size=33)]
    prompts = [[int(t) for t in rng.integers(3, 300, size=n)] for n in (1, 7, 16, 17, 40)]
    prompts += [shared + [int(t) for t in rng.integers(3, 300, size=n)] for n in (2, 15)] + [list(shared)]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.9, seed=7, n=3),
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[17, 40, 99, 101, 150], min_tokens=3),
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=3, stop=["e", "o "]),
        SamplingParams(max_tokens=16, temperature=0, logprobs=3, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_tokens=22, temperature=1.0, top_k=20, seed=11, frequency_penalty=0.4, n=2),
        SamplingParams(max_tokens=12, temperature=0.5, seed=1, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, stop=["the"], ignore_eos=True),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def _count_fed_on_device(engine) -> dict:
    """Count launches whose input tokens partly come from the previous step's device output."""
    fed, launch = {"steps": 0}, engine.runner.launch

    def counting(out, prev=None, pending=frozenset()):
        fed["steps"] += bool(pending)
        return launch(out, prev, pending)
    engine.runner.launch = counting
    return fed


def _run(engine: LLMEngine, tag: str, abort_at: dict, stream: bool = True) -> dict:
    """Drive the engine to the end; abort request id `r` right after step abort_at[r]. Returns
    id -> what the caller saw last (for aborted ids: None, and nothing may come after the abort).
    stream=False: the engine must return only final outputs."""
    prompts, params = _workload()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}{i}", p, sp, stream=stream)
    seen, step = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in seen or not seen[o.request_id]["finished"]
            assert stream or o.finished
            seen[o.request_id] = dict(finished=o.finished, outs=[
                (c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs])
        step += 1
        for rid, at in abort_at.items():
            if step == at:
                engine.abort_request(f"{tag}{rid}")
                seen[f"{tag}{rid}"] = None
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == s["num_waiting"] == 0
    assert all(c == 0 for c in engine.block_manager.ref_count)
    return {rid[len(tag):]: v for rid, v in seen.items()}


@pytest.mark.parametrize("forced", [dict(), dict(num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["roomy", "preempt+chunked"])
def test_async_outputs_equal_sync(model, compile_cache, forced):
    kw = {**dict(model=model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                 compilation_cache_dir=compile_cache, show_progress=False), **forced}
    results = {}
    for mode in (False, True):
        eng = LLMEngine(EngineConfig(async_scheduling=mode, **kw))
        fed = _count_fed_on_device(eng)
        first = _run(eng, "a", {})
        again = _run(eng, "b", {"2": 4, "6": 9})  # prefix cache hits; aborts in flight
        _assert_same(again, _run(eng, "c", {"2": 4, "6": 9}, stream=False))  # final outputs only: the same
        results[mode] = (first, again, eng.stats())
        assert (fed["steps"] > 10) == mode  # async: tokens did go from step to step on the device
        assert all(v["finished"] for v in first.values())
    (s_first, s_again, s_stats), (a_first, a_again, a_stats) = results[False], results[True]
    _assert_same(s_first, a_first)
    _assert_same(s_again, a_again)
    assert a_again["2"] is None and a_again["6"] is None  # aborted: nothing came after the abort
    assert a_stats["prefix_cache_hit_rate"] > 0 and s_stats["prefix_cache_hit_rate"] > 0
    if forced:
        assert s_stats["num_preemptions"] > 0 and a_stats["num_preemptions"] > 0
    reasons = {c[2] for v in s_first.values() for c in v["outs"]}
    assert {"stop", "length"} <= reasons  # the stop paths were taken


def test_outputs_do_not_depend_on_the_number_of_slots(model, compile_cache):
    """Logits and sampling run only over the rows of the slots a step advances (R = min(S, T) rows):
    with 32 slots, the 8- and 16-token steps sample 8 and 16 rows, padded, in slot order; every output
    (greedy, seeded, penalties, logprobs, stop strings, n > 1) equals that of an engine of 8 slots."""
    kw = dict(model=model, dtype="float32", max_num_batched_tokens=64, max_model_len=128,
              compilation_cache_dir=compile_cache, show_progress=False)
    narrow = _run(LLMEngine(EngineConfig(max_num_seqs=8, **kw)), "a", {})
    wide_engine = LLMEngine(EngineConfig(max_num_seqs=32, **kw))
    rows = []
    launch = wide_engine.runner.launch

    def counting(out, prev=None, pending=frozenset()):
        rows.append((len(out.scheduled), min(32, wide_engine.runner.bucket_for(out.num_tokens))))
        return launch(out, prev, pending)
    wide_engine.runner.launch = counting
    _assert_same(narrow, _run(wide_engine, "a", {}))
    assert any(r < 32 and k < r for k, r in rows)  # steps of fewer rows than slots, some of them padding


def _assert_same(sync: dict, asyn: dict) -> None:
    """Token ids, text and finish reasons equal; logprobs over the same ids, equal to float32 rounding
    (a different batch around a request changes the step's float sums in the last bits)."""
    assert sync.keys() == asyn.keys()
    for rid in sync:
        if sync[rid] is None or asyn[rid] is None:
            assert sync[rid] is asyn[rid], rid
            continue
        assert sync[rid]["finished"] == asyn[rid]["finished"], rid
        for (ids, text, reason, lps), (ids2, text2, reason2, lps2) in zip(sync[rid]["outs"], asyn[rid]["outs"]):
            assert (ids, text, reason) == (ids2, text2, reason2), rid
            assert (lps is None) == (lps2 is None), rid
            for a, b in zip(lps or [], lps2 or []):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a), rid


@pytest.mark.parametrize("where,consume_pool", [("launch", False), ("launch", True), ("read", True)])
def test_async_step_failure_fails_only_its_requests(model, compile_cache, where, consume_pool):
    """A step that fails when started (or when read back, its error surfacing one step late) fails its own
    requests; the others finish exactly as in a synchronous run, and every block is freed."""
    kw = dict(model=model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              compilation_cache_dir=compile_cache, show_progress=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in _workload()[0]]
    sync = _generate(LLMEngine(EngineConfig(**kw)), prompts, params)
    want = {o.request_id: o.outputs[0].token_ids for o in sync}
    eng = LLMEngine(EngineConfig(async_scheduling=True, **kw))
    real, calls, failed = getattr(eng.runner, where), [0], set()

    def failing(*a):
        calls[0] += 1
        if calls[0] == 4:
            step = a[0]
            failed.update(r.group_id for r, _ in (step.out if where == "read" else step).scheduled)
            if consume_pool:
                eng.runner.k_pool.delete()
                eng.runner.v_pool.delete()
            raise RuntimeError("injected failure")
        return real(*a)
    setattr(eng.runner, where, failing)
    got = {o.request_id: o for o in _generate(eng, prompts, params)}
    assert failed and len(failed) < len(prompts) and got.keys() == want.keys()
    for rid, toks in want.items():
        if rid in failed:
            assert got[rid].outputs[0].finish_reason == "error" and "error id" in got[rid].error
        else:
            assert got[rid].error is None and got[rid].outputs[0].token_ids == toks, rid
    s = eng.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and all(c == 0 for c in eng.block_manager.ref_count)


def _generate(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done


def test_async_scheduling_flag():
    """`--async-scheduling` / `--no-async-scheduling` reach EngineConfig; without either, the platform's
    default (None: off on this CPU)."""
    import argparse

    from jaxpaged.args import add_engine_args, engine_kwargs
    from serve.app import add_serve_args
    engine_only = argparse.ArgumentParser()
    add_engine_args(engine_only)
    for parser in (engine_only, add_serve_args(argparse.ArgumentParser())):
        for argv, want, resolved in (([], None, False), (["--async-scheduling"], True, True),
                                     (["--no-async-scheduling"], False, False)):
            kw = engine_kwargs(parser.parse_args(argv))
            assert kw["async_scheduling"] is want
            assert EngineConfig(**kw).async_scheduling is resolved


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_has_no_reference_cycles(model, compile_cache, async_scheduling):
    """The engine freezes the start-up heap out of the collector's reach (engine._freeze_startup_heap),
    which is safe only because a dropped engine is freed by reference counting alone, after it has run
    (steps in flight, finished and aborted requests): its weights and pool go without the collector."""
    import gc
    import weakref
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                                    max_model_len=64, compilation_cache_dir=compile_cache, show_progress=False,
                                    async_scheduling=async_scheduling))
    assert gc.get_freeze_count() > 0
    engine.add_request("a", "hello world", SamplingParams(max_tokens=6, temperature=0, stop=["zz"]))
    engine.add_request("b", "hello there", SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=3))
    for _ in range(4):
        engine.step()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    refs = [weakref.ref(x) for x in (engine, engine.runner, engine.scheduler, engine.block_manager)]
    pool = engine.runner.k_pool
    pool = weakref.ref(pool) if not hasattr(pool, "values") else weakref.ref(pool.values)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert [r() is None for r in refs] == [True] * len(refs)
        assert pool() is None
    finally:
        if was_enabled:
            gc.enable()
