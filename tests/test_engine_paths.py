"""Forced engine paths (preemption, chunked prefill, prefix cache hits, caching off) never change outputs."""
import numpy as np
import pytest
from oracle import hf_greedy

from jaxpaged import LLM, SamplingParams
from jaxpaged.step.runner import has_lone_bucket, token_buckets

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _workload():
    rng = np.random.default_rng(11)
    shared = [int(t) for t in rng.integers(3, 256, size=40)]
    prompts = [[int(t) for t in rng.integers(3, 256, size=n)] for n in (1, 5, 15, 16, 17, 31, 70)]
    prompts += [shared + [int(t) for t in rng.integers(3, 256, size=n)] for n in (1, 9, 20)]
    prompts += [list(shared)]
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def baseline(tiny_models, engine_kwargs):
    path = tiny_models["llama"]
    llm = LLM(model=path, **engine_kwargs)
    outs = llm.generate(_workload(), GREEDY, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    for p, t in list(zip(_workload(), toks))[::4]:  # the baseline itself agrees with HF
        assert t == hf_greedy(path, p["prompt_token_ids"], 24)
    return toks


def _run(path, kwargs, **over):
    llm = LLM(model=path, **{**kwargs, **over})
    outs = llm.generate(_workload(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_preemption_keeps_outputs(tiny_models, engine_kwargs, baseline):
    toks, llm = _run(tiny_models["llama"], engine_kwargs, num_kv_blocks=14)
    assert llm.stats()["num_preemptions"] > 0
    assert toks == baseline
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]  # cached blocks are evictable


def test_chunked_prefill_keeps_outputs(tiny_models, engine_kwargs, baseline):
    toks, llm = _run(tiny_models["llama"], engine_kwargs, max_num_batched_tokens=16)
    assert llm.engine.runner.buckets == [8, 16]  # every prompt over 16 tokens was chunked
    assert toks == baseline


def test_prefix_cache_hits_keep_outputs(tiny_models, engine_kwargs, baseline):
    llm = LLM(model=tiny_models["llama"], **engine_kwargs, enable_prefix_caching=True)
    first = [o.outputs[0].token_ids for o in llm.generate(_workload(), GREEDY, use_tqdm=False)]
    again = llm.generate(_workload(), GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_rate"] > 0.3
    assert sum(o.num_cached_tokens for o in again) >= 4 * 32
    assert first == baseline and [o.outputs[0].token_ids for o in again] == baseline


def test_prefix_caching_off_keeps_outputs(tiny_models, engine_kwargs, baseline):
    toks, llm = _run(tiny_models["llama"], engine_kwargs, enable_prefix_caching=False)
    assert llm.stats()["prefix_cache_hit_rate"] == 0
    assert toks == baseline


def test_everything_forced_at_once(tiny_models, engine_kwargs, baseline):
    toks, llm = _run(tiny_models["llama"], engine_kwargs, num_kv_blocks=9, max_num_batched_tokens=16,
                     max_num_seqs=3)
    assert llm.stats()["num_preemptions"] > 0
    assert toks == baseline


def test_compilations_bounded_by_buckets(tiny_models, engine_kwargs):
    llm = LLM(model=tiny_models["llama"], **{**engine_kwargs, "warmup": True})
    n0 = llm.stats()["num_compilations"]
    assert n0 == llm.stats()["num_buckets"] == len(llm.engine.runner.buckets)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, size=int(n))]}
               for n in rng.integers(1, 120, size=40)]
    params = [SamplingParams(max_tokens=int(m), temperature=float(t), top_p=0.9, seed=i, ignore_eos=True)
              for i, (m, t) in enumerate(zip(rng.integers(1, 40, size=40), rng.uniform(0, 1.5, size=40)))]
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_compilations"] == n0


@pytest.mark.slow
def test_pallas_backend_matches_reference(tiny_models, engine_kwargs):
    """The engine on the Pallas kernels (interpret mode on CPU) gives the reference backend's tokens,
    through prefill chunks mixed with decodes and decode-only steps."""
    path = tiny_models["qwen3"]
    prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(3, 256, size=n)]}
               for i, n in enumerate((3, 20, 37))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = {**engine_kwargs, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    want = [o.outputs[0].token_ids for o in LLM(model=path, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=path, **{**kw, "warmup": True}, attention_backend="pallas")
    assert llm.stats()["attention_backend"] == "triton"  # pallas on a CPU target: Triton, interpret mode
    assert llm.stats()["num_compilations"] == len(llm.engine.runner.variants()) > len(llm.engine.runner.buckets)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_lone_requests_take_the_one_token_bucket(tiny_models, engine_kwargs):
    """On a CPU whose products are its kernels (bfloat16 weights here), without speculation, a lone request's
    decode steps run the 1-token bucket (runner.has_lone_bucket), with the tokens and logprobs of bucket 8."""
    llm = LLM(model=tiny_models["llama"], **{**engine_kwargs, "dtype": "bfloat16", "enable_prefix_caching": False})
    runner = llm.engine.runner
    assert runner.buckets[:2] == [1, 8] and llm.stats()["matmul_backend"].startswith("cpu")
    taken = []
    runner.wrap_steps(lambda key, compiled: (taken.append(key[0]), compiled())[1])
    prompts = _workload()[::3]  # prompts of 1, 16, 70 and 49 tokens, each alone
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    def lone(prompt):
        o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        return o.token_ids, [{t: lp[t] for t in lp} for lp in o.logprobs]
    got = [lone(p) for p in prompts]
    # every decode step (the first token comes from the prefill), and the 1-token prompt's prefill
    assert taken.count(1) == len(prompts) * (params.max_tokens - 1) + 1
    runner.buckets = runner.buckets[1:]  # bucket 8 for the same requests
    assert [lone(p) for p in prompts] == got


def test_lone_bucket_only_for_the_cpus_own_plain_steps():
    assert has_lone_bucket("cpu", "cpu", False, True) and has_lone_bucket("cpu", "reference", False, True)
    assert not has_lone_bucket("cpu", "cpu", False, False)  # XLA's dots: a 1-row product rounds otherwise
    assert not has_lone_bucket("cpu", "cpu", True, True)  # speculation: the proposals fill bucket 8's padding
    assert not has_lone_bucket("cpu", "triton", False, True)  # an accelerator's kernel, interpreted
    assert not has_lone_bucket("tpu", "mosaic_tpu", False, True) and not has_lone_bucket("gpu", "triton", False, True)
    assert token_buckets(512, lone=True) == [1, 8, 16, 32, 64, 128, 256, 512] and token_buckets(512)[0] == 8
    assert token_buckets(4, lone=True) == [1, 4] and token_buckets(1, lone=True) == [1]
