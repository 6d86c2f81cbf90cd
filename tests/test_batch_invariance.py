"""batch_invariant=True: 20 seeded requests, each alone and then among 63 others (in another slot, under
other buckets, beside others' prefill chunks, its own prompt chunked differently), at two token budgets,
through preemption and prefix-cache hits: token ids and logprobs bit for bit (float32 and bfloat16). And
the check itself has teeth: a deliberately batch-dependent reduction is caught."""
import random

import jax.numpy as jnp
import pytest

from jaxpaged import LLM, SamplingParams

SEEDS = range(20)
SLOTS = 64


def _target(seed):
    rng = random.Random(seed)
    prompt = {"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randint(5, 40))]}
    return prompt, SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]), seed=seed,
                                  max_tokens=6, logprobs=3, ignore_eos=True)


def _others(rng, n):
    prompts = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randint(1, 70))]} for _ in range(n)]
    params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), top_k=rng.choice([0, 20]), seed=i,
                             max_tokens=rng.randint(1, 10), ignore_eos=True) for i in range(n)]
    return prompts, params


def mismatches(alone_llm, mixed_llm, seeds=SEEDS) -> list:
    """Generate each seed's request alone on `alone_llm`, then the seeds in batches of up to 64 with random
    others (random slots) on `mixed_llm`; return the seeds whose tokens or logprobs differ in any bit."""
    alone = {s: alone_llm.generate([_target(s)[0]], _target(s)[1], use_tqdm=False)[0].outputs[0] for s in seeds}
    rng, seeds, bad = random.Random(len(seeds)), list(seeds), []
    for i in range(0, len(seeds), 8):
        group = seeds[i:i + 8]
        prompts, params = _others(rng, SLOTS - len(group))
        at = dict(zip(group, rng.sample(range(SLOTS), len(group))))  # each target somewhere in the batch
        for s, j in sorted(at.items(), key=lambda kv: kv[1]):
            prompts.insert(j, _target(s)[0])
            params.insert(j, _target(s)[1])
        outs = mixed_llm.generate(prompts, params, use_tqdm=False)
        for s in group:
            got, want = outs[at[s]].outputs[0], alone[s]
            if got.token_ids != want.token_ids or got.logprobs != want.logprobs:
                bad.append(s)
    return bad


@pytest.fixture(scope="module")
def kw(engine_kwargs):
    return dict(engine_kwargs, max_num_seqs=SLOTS, batch_invariant=True, max_logprobs=5)


@pytest.fixture(scope="module")
def base(tiny_models, kw):
    return LLM(model=tiny_models["llama"], **kw)


@pytest.mark.parametrize("case", ["same_engine", "budget_256", "preemption"])
def test_batch_invariant_float32(tiny_models, kw, base, case):
    other = {"same_engine": None, "budget_256": dict(max_num_batched_tokens=256),
             "preemption": dict(num_kv_blocks=24)}[case]
    mixed = base if other is None else LLM(model=tiny_models["llama"], **{**kw, **other})
    assert mismatches(base, mixed) == []
    if case == "preemption":
        assert mixed.stats()["num_preemptions"] > 0
    if case == "same_engine":  # the targets' prompts were cached by their runs alone: prefix hits
        assert mixed.stats()["prefix_cache_hit_rate"] > 0


def test_batch_invariant_bfloat16(tiny_models, kw):
    llm = LLM(model=tiny_models["llama"], **{**kw, "dtype": "bfloat16"})
    assert mismatches(llm, llm, seeds=range(8)) == []


def test_check_catches_a_batch_dependent_reduction(tiny_models, kw, monkeypatch):
    from jaxpaged.step import traced

    lm_logits = traced.lm_logits

    def leaky(params, cfg, h):  # logits shifted by a mean over every row of the step: batch-dependent
        return lm_logits(params, cfg, h) + 1e-3 * jnp.mean(h)
    monkeypatch.setattr(traced, "lm_logits", leaky)
    llm = LLM(model=tiny_models["llama"], **{**kw, "warmup": False})
    assert len(mismatches(llm, llm, seeds=range(8))) >= 4


def test_batch_invariant_refuses_moe(tiny_models, kw, tmp_path):
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(str(tmp_path / "moe"), "mixtral")
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(model=path, **kw)
