"""logprob_token_ids (vLLM's): the logprobs of chosen ids at every generated position, beside the sampled
token's, equal to those of the whole vocabulary asked; in a mixed batch, under speculative decoding (the
verified rows), and refused where they cannot be given."""
import pytest

from jaxpaged import LLM, SamplingParams

V = 256  # jaxpaged/testing/tiny_models.py's tiny vocabulary
PROMPTS = [{"prompt_token_ids": [3, 17, 9, 44, 3, 17, 9, 44, 3, 17]}, {"prompt_token_ids": [5, 6, 7]}]
IDS = [200, 5, 17, 5, 0]  # a duplicate, dropped


@pytest.fixture(scope="module")
def engines(tiny_models, engine_kwargs):
    kw = dict(engine_kwargs, max_logprobs=V, warmup=False)  # one bucket used: compile only it
    return {"plain": LLM(model=tiny_models["llama"], **kw),
            "ngram": LLM(model=tiny_models["llama"], speculative_config={
                "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, **kw)}


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_logprob_token_ids_equal_the_whole_vocabulary(engines, which):
    llm = engines[which]
    full = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=V)
    asked = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprob_token_ids=IDS)
    assert asked.logprobs == 0 and asked.logprob_token_ids == [200, 5, 17, 0]
    want = [o.outputs[0] for o in engines["plain"].generate(PROMPTS, full, use_tqdm=False)]
    outs = llm.generate(PROMPTS, [asked, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)],
                        use_tqdm=False)
    got, other = outs[0].outputs[0], outs[1].outputs[0]
    assert got.token_ids == want[0].token_ids and other.logprobs is None
    for tok, lp, ref in zip(got.token_ids, got.logprobs, want[0].logprobs):
        assert list(lp) == list(dict.fromkeys([tok, 200, 5, 17, 0]))  # the sampled token, then the ids asked
        for t, v in lp.items():
            assert v == pytest.approx(ref[t], abs=1e-4), (t, v, ref[t])


def test_logprob_token_ids_refused(engines, tiny_models, engine_kwargs):
    llm = engines["plain"]
    for ids, why in (([], "non-empty"), ([V], "out of vocabulary"), (list(range(129)), "at most 128")):
        with pytest.raises(ValueError, match=why) as e:
            llm.engine.add_request(None, PROMPTS[1], SamplingParams(logprob_token_ids=ids))
        assert e.value.param == "logprob_token_ids"
    processed = LLM(model=tiny_models["llama"], **dict(engine_kwargs, warmup=False, logprobs_mode="processed_logprobs"))
    with pytest.raises(ValueError, match="raw logits") as e:
        processed.engine.add_request(None, PROMPTS[1], SamplingParams(logprob_token_ids=[1]))
    assert e.value.param == "logprob_token_ids"
