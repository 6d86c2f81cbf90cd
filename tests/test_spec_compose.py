"""Speculative decoding composes with the sampling controls, logprobs modes, research hooks and scale-out:
each, with proposals accepted at every position and rejected, gives a plain run's output token for token
(greedy and seeded sampling, float32), so every control is applied at each proposed position as a plain
run applies it one step later (penalties and bad words see d_1 .. d_j; grammars consume them and roll
back). Helpers and the tiny model come from tests/test_spec_decode.py."""
import json
import re

import numpy as np
import pytest
from test_spec_decode import GREEDY, NGRAM, SAMPLED, AlwaysPropose, V, _prompts, model  # noqa: F401 -- model: fixture

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams


class SampleOracle:
    """The plain run's continuation of each (prompt, sample index), every fifth proposal wrong: accepted
    runs at every position, and rejections (the wrong ones may be tokens a grammar or a ban refuses)."""
    def __init__(self, outputs):
        self.truth = {(tuple(o.prompt_token_ids), c.index): list(c.token_ids) for o in outputs for c in o.outputs}

    def propose(self, req, k):
        out = self.truth.get((tuple(req.prompt_token_ids), req.index), [])
        o = req.num_output_tokens
        return [t if (o + j) % 5 != 4 else (t + 1) % V for j, t in enumerate(out[o:o + k])]

    def retain(self, request_ids):
        pass


def _speculative(llm, proposer):
    llm.engine.spec.governor = AlwaysPropose()
    llm.engine.spec.proposer = proposer
    return llm


@pytest.fixture(scope="module")
def pair(model, engine_kwargs):
    """(plain LLM, speculative LLM) on the same tiny model and settings."""
    return LLM(model=model, **engine_kwargs), _speculative(LLM(model=model, **engine_kwargs, speculative_config=NGRAM),
                                                           None)


def _same(a, b, prompt_logprobs=False):
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
        assert [c.finish_reason for c in x.outputs] == [c.finish_reason for c in y.outputs]
        for cx, cy in zip(x.outputs, y.outputs):
            for da, db in zip(cx.logprobs or [], cy.logprobs or []):
                assert da.keys() == db.keys() and np.allclose(list(da.values()), list(db.values()), atol=1e-4)
        if prompt_logprobs:
            assert x.prompt_logprobs[0] is None and len(x.prompt_logprobs) == len(x.prompt_token_ids)
            for da, db in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
                assert da.keys() == db.keys() and np.allclose(list(da.values()), list(db.values()), atol=1e-4)


def _check(pair, params, prompts=None, lora_request=None, **kw):
    """Plain outputs, then the speculative engine's with the oracle built from them: equal. Returns both."""
    base, spec = pair
    prompts = prompts or _prompts()
    st0 = dict(spec.engine.stats())
    a = base.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    spec.engine.spec.proposer = SampleOracle(a)
    b = spec.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    _same(a, b, **kw)
    st = spec.engine.stats()
    drafted = st["spec_decode_num_draft_tokens"] - st0["spec_decode_num_draft_tokens"]
    accepted = st["spec_decode_num_accepted_tokens"] - st0["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted  # runs accepted, and rejections
    return a, b


def _with(base, **kw):
    return SamplingParams(**{**base.__dict__, **kw})


@pytest.mark.parametrize("kw", [dict(n=3), dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.4),
                                dict(logit_bias={17: 4.0, 40: -3.0}, allowed_token_ids=list(range(3, 200))),
                                dict(min_tokens=6, repetition_penalty=1.2)],
                         ids=["n", "penalties", "bias+allowed", "min_tokens+penalty"])
def test_sampling_controls(pair, kw):
    for base in (GREEDY, SAMPLED):
        _check(pair, _with(base, logprobs=2, **kw))


def test_prompt_logprobs(pair):
    _check(pair, _with(SAMPLED, prompt_logprobs=3, logprobs=1), prompt_logprobs=True)


def test_bad_words(pair):
    """A two-token bad word whose first token appears in the output: its second is banned right after it,
    at whatever position of an accepted run that falls."""
    base, _ = pair
    tok = base.engine.tokenizer
    prompts = _prompts()[:5]
    free = base.generate(prompts, GREEDY, use_tqdm=False)
    from jaxpaged.core.logit_controls import bad_words_token_ids
    word = next(w for o in free for i in range(2, 20) for w in [tok.decode(o.outputs[0].token_ids[i:i + 2])]
                if w.strip() and len(bad_words_token_ids([w], tok)[0]) == 2)
    a, _ = _check(pair, _with(GREEDY, bad_words=[word]), prompts)
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in free]  # the ban mattered
    _check(pair, _with(SAMPLED, bad_words=[word, "ab"]), prompts)


@pytest.mark.parametrize("constraint", [dict(regex="[a-e ]{12,40}"),
                                        dict(json={"type": "object", "properties": {"k": {"enum": [11, 22, 33]},
                                                   "v": {"type": "string", "maxLength": 12}},
                                                   "required": ["k", "v"], "additionalProperties": False})],
                         ids=["regex", "json"])
def test_structured_outputs(pair, constraint):
    """The mask at every proposed position, the matcher rolled back after rejections; the output holds."""
    so = StructuredOutputsParams(**constraint)
    for base in (_with(GREEDY, max_tokens=40, ignore_eos=False), _with(SAMPLED, max_tokens=40, ignore_eos=False,
                                                                        temperature=1.0, top_k=0)):
        a, _ = _check(pair, _with(base, structured_outputs=so, logprobs=1))
        for o in a:
            text = o.outputs[0].text
            if "regex" in constraint and o.outputs[0].finish_reason == "stop":
                assert re.fullmatch("[a-e ]{12,40}", text), text
            if "json" in constraint and o.outputs[0].finish_reason == "stop":
                assert json.loads(text)["k"] in (11, 22, 33), text


def test_ngram_proposer_with_controls(pair):
    """The real proposer on repeating prompts, with penalties, n > 1 and prompt logprobs at once."""
    base, spec = pair
    from jaxpaged.spec_decode.ngram import NgramProposer
    spec.engine.spec.proposer = NgramProposer(3, 1, 3)
    st0 = dict(spec.engine.stats())
    p = _with(GREEDY, n=2, frequency_penalty=0.05, prompt_logprobs=1, logprobs=1)
    _same(base.generate(_prompts(), p, use_tqdm=False), spec.generate(_prompts(), p, use_tqdm=False),
          prompt_logprobs=True)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > st0["spec_decode_num_accepted_tokens"]


def test_tensor_and_data_parallel(tmp_path):
    """DP 2 x TP 2 on 8 simulated devices (a subprocess: tests/tensor_parallel_checks.py spec):
    the plain TP=1 tokens, greedy and seeded with a penalty, through preemption and chunked prefill, with
    n-gram-style proposals and with a draft model."""
    from test_tensor_parallel import _checks
    f = _checks(tmp_path, "spec")["spec"]
    assert f["dp2tp2"]["tokens"] == f["plain"]
    assert 0 < f["dp2tp2"]["accepted"] < f["dp2tp2"]["drafted"] and f["dp2tp2"]["replicas_used"] == 2
    # a draft model on each replica's mesh (the target as its own draft): greedy tokens are the plain ones;
    # seeded ones need not be (the draft's q has no penalties: exact in distribution, not token for token)
    d = f["draft_dp2tp2"]
    assert d["tokens"][0] == f["plain"][0] and [len(t) for t in d["tokens"][1]] == [len(t) for t in f["plain"][1]]
    assert d["accepted"] >= 0.5 * d["drafted"] > 0 and d["replicas_used"] == 2


@pytest.mark.parametrize("mode", ["processed_logprobs", pytest.param("processed_logits", marks=pytest.mark.slow),
                                  pytest.param("raw_logits", marks=pytest.mark.slow)])
def test_logprobs_modes_and_research_hooks(model, engine_kwargs, mode):
    """The processed distributions at each position (penalties, bias, temperature, top-k), the hidden
    states of the accepted tokens only (and the prompt's), and steering applied to the proposals' rows;
    n = 2 and a grammar, through preemption, chunked prefill and prefix hits."""
    kw = dict(engine_kwargs, num_kv_blocks=12, max_num_batched_tokens=16, logprobs_mode=mode,
              hidden_state_layers=[0, 2], steering_layers=[1])
    pair = (LLM(model=model, **kw), _speculative(LLM(model=model, **kw, speculative_config=NGRAM), None))
    steer = {1: np.random.default_rng(0).normal(size=64).astype(np.float32)}
    for base in (_with(GREEDY, min_tokens=4), _with(SAMPLED, n=2)):
        p = _with(base, logprobs=3, repetition_penalty=1.3, presence_penalty=0.2, logit_bias={9: 2.0},
                  return_hidden_states=True, return_prompt_hidden_states=True, steering_vectors=steer)
        a, b = _check(pair, p, _prompts()[2:])
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.prompt_hidden_states, y.prompt_hidden_states, rtol=1e-5, atol=1e-5)
            for cx, cy in zip(x.outputs, y.outputs):
                hx, hy = cx.hidden_states, cy.hidden_states
                assert hx.shape == hy.shape == (len(cx.token_ids), 2, 64)
                np.testing.assert_allclose(hx, hy, rtol=1e-4, atol=1e-4)
    _check(pair, _with(SAMPLED, n=2, max_tokens=30, ignore_eos=False, frequency_penalty=0.3,
                       structured_outputs=StructuredOutputsParams(regex="[a-e ]{12,40}")), _prompts()[2:])
    st = pair[1].engine.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_rate"] > 0


def test_lora(model, engine_kwargs, tmp_path):
    """Adapters and the base model in one batch: each proposal's row runs its request's adapter."""
    from lora_adapters import make_adapter

    from jaxpaged import LoRARequest
    loras = [LoRARequest(f"a{j}", j + 1, make_adapter(str(tmp_path / f"a{j}"), model, seed=40 + j, r=4))
             for j in range(2)]
    kw = dict(engine_kwargs, max_num_batched_tokens=32, enable_lora=True, max_loras=2, max_lora_rank=4)
    pair = (LLM(model=model, **kw), _speculative(LLM(model=model, **kw, speculative_config=NGRAM), None))
    per_prompt = [loras[i % 2] if i % 3 else None for i in range(len(_prompts()))]
    for base in (GREEDY, SAMPLED):
        _check(pair, base, lora_request=per_prompt)
