"""Prompt logprobs (computed in the step from prefill chunks) and LLM.score (a dense forward), against
transformers' log_softmax on tiny random float32 models; with chunked prefill, a prefix hit, preemption."""
import numpy as np
import pytest
from oracle import hf_model

from jaxpaged import LLM, SamplingParams
from jaxpaged.testing.tiny_models import FAMILIES, NEW_FAMILIES, make_tiny_model

BS = 4
FAST = ("llama", "gemma2", "mixtral")  # untied, soft-capped and tied, MoE; the others are the same code
ALL = list(FAST) + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES + NEW_FAMILIES if f not in FAST]
assert {getattr(f, "values", [f])[0] for f in ALL} == set(FAMILIES) | set(NEW_FAMILIES)


def hf_logprobs(path, ids, with_scale=False):
    """log_softmax of transformers' logits at every position: [len(ids), V] (and the largest |logit|)."""
    import torch
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1).numpy()
    return (lp, float(logits.abs().max())) if with_scale else lp


def _engine(path, engine_kwargs, **over):
    # a budget of 8 tokens (one bucket, one compilation): prompts of 40 tokens prefill in chunks
    return LLM(model=path, **{**engine_kwargs, "block_size": BS, "max_num_batched_tokens": 8, "max_num_seqs": 4,
                              "max_model_len": 128, **over})


def _prompt(seed, n=40, vocab=256):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def check_prompt_logprobs(path, prompt, got, k):
    """got: RequestOutput.prompt_logprobs; each entry has the prompt token's logprob and the top k."""
    want, scale = hf_logprobs(path, prompt, with_scale=True)  # tolerance as in test_families: to the logits
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        entry, row = got[j], want[j - 1]
        top = np.argsort(-row)[:k]
        assert set(top) | {prompt[j]} == set(entry), j
        for t, v in entry.items():
            np.testing.assert_allclose(v, row[t], rtol=1e-5, atol=1e-4 * max(1.0, scale))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("plp") / "llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(llama, engine_kwargs):
    return _engine(llama, engine_kwargs, enable_prefix_caching=True)


@pytest.mark.parametrize("family", ALL)
def test_prompt_logprobs_match_hf(tmp_path_factory, engine_kwargs, family):
    """Every family, prompts prefilled in chunks of 16 tokens, two requests in one batch (one asks)."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("plp") / family), family, seed=7)
    llm = _engine(path, engine_kwargs)
    a, b = _prompt(1), _prompt(2, 23)
    outs = llm.generate([a, b], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                                 SamplingParams(max_tokens=2, temperature=0)])
    check_prompt_logprobs(path, a, outs[0].prompt_logprobs, 3)
    assert outs[1].prompt_logprobs is None


def test_prefix_hit_and_preemption(llama, llm, engine_kwargs):
    """The prefix cache is bypassed for a request that asks (documented): a cached prompt still gets every
    entry, and its blocks serve the next request; preemption (a tiny pool) recomputes without duplicates."""
    p = _prompt(4)
    first = llm.generate([p], SamplingParams(max_tokens=1, temperature=0))[0]
    asks = llm.generate([p], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    again = llm.generate([p], SamplingParams(max_tokens=1, temperature=0))[0]
    assert first.num_cached_tokens == 0 and asks.num_cached_tokens == 0 and again.num_cached_tokens == 36
    check_prompt_logprobs(llama, p, asks.prompt_logprobs, 2)

    small = _engine(llama, engine_kwargs, num_kv_blocks=24)  # 23 usable: two 40 + 20 token requests do not fit
    ps = [_prompt(5), _prompt(6)]
    outs = small.generate(ps, SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=1, ignore_eos=True))
    assert small.stats()["num_preemptions"] > 0
    for p, o in zip(ps, outs):
        check_prompt_logprobs(llama, p, o.prompt_logprobs, 1)


def test_score_equals_generate_and_hf(llama, llm):
    """score(prompt, generated tokens) == the logprobs generate reported for them (float32, within 2e-5),
    and == transformers' log_softmax; continuations as token ids. Decode steps round differently from a
    dense forward (XLA CPU's matmul sums in an order that depends on the number of rows, docs/research.md):
    over 6 seeds x 2 tiny models the largest difference measured was 1.24e-5."""
    prompts = [_prompt(7, 5), _prompt(8, 11), _prompt(9, 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=0,
                                                ignore_eos=True))
    conts = [o.outputs[0].token_ids for o in outs]
    scores = llm.score(prompts, conts)
    worst = 0.0
    for p, c, o, s in zip(prompts, conts, outs, scores):
        gen = [lp[t] for lp, t in zip(o.outputs[0].logprobs, c)]
        worst = max(worst, float(np.abs(np.subtract(s, gen)).max()))
        want = hf_logprobs(llama, p + c)[np.arange(len(p) - 1, len(p) + len(c) - 1), c]
        np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-4)
    assert worst <= 2e-5, worst
    print(f"largest |score - generate logprob|: {worst:.2e}")
    with pytest.raises(ValueError, match="continuations"):
        llm.score(prompts, conts[:2])
    with pytest.raises(ValueError, match="continuations"):
        llm.score([prompts[0]], [[]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.score([prompts[0]], [[5] * 200])
    assert llm.score(prompts[0], conts[0]) == [scores[0]]  # one pair, not in lists


def test_dense_logprobs_recipe(llama, llm):
    """docs/research.md's call of the pure function, against transformers."""
    import jax

    from jaxpaged.step.attention import make_attention
    from jaxpaged.step.scoring import dense_logprobs
    r = llm.engine.runner
    tokens = np.array([[1, 2, 3, 4, 5, 0, 0, 0]], np.int32)
    lp = jax.jit(lambda p, t: dense_logprobs(p, r.step_cfg, t, make_attention(r.backend, False),
                                             block_size=r.block_size))(r.params, tokens)
    want = hf_logprobs(llama, [1, 2, 3, 4, 5])
    np.testing.assert_allclose(np.asarray(lp)[0, :4], want[np.arange(4), [2, 3, 4, 5]], rtol=1e-5, atol=1e-4)
