"""Hypothesis drives LLMEngine with random requests: valid ones complete; a request with one bad field
raises a ValueError naming that field (InvalidParam.param) and queues nothing; the engine is never left
broken (every block free at the end)."""
import math

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from jaxpaged import SamplingParams
from jaxpaged.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from jaxpaged.core.validation import InvalidParam
from jaxpaged.engine import EngineConfig, LLMEngine
from jaxpaged.step.runner import NUM_BANNED
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model

V, L, MAX_TOKENS = 320, 256, 5
# as many stop strings as allowed, as many characters in all as allowed, none of them ever generated
STOPS_AT_BOUND = [f"{i:02d}" + "\x00" * (MAX_STOP_CHARS // MAX_STOP_STRINGS - 2) for i in range(MAX_STOP_STRINGS)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, engine_kwargs):
    path = str(tmp_path_factory.mktemp("tok_model"))
    make_tiny_model(path, "llama", vocab_size=V, seed=3, initializer_range=0.3)  # as test_sampling's
    add_tiny_tokenizer(path)
    eng = LLMEngine(EngineConfig(model=path, **engine_kwargs))
    assert eng.request_limits() == dict(vocab_size=V, max_model_len=L, max_logprobs=20,
                                        max_banned_ids=NUM_BANNED, num_eos_ids=len(eng.eos_token_ids))
    return eng


def real(lo, hi):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


@st.composite
def valid_requests(draw):
    max_tokens = draw(st.integers(1, MAX_TOKENS))
    kw = dict(n=draw(st.integers(1, 3)), temperature=draw(st.sampled_from([0.0, 0.7]) | real(0, 5)),
              top_p=draw(real(0.01, 1)), top_k=draw(st.integers(-1, V)), min_p=draw(real(0, 1)),
              seed=draw(st.none() | st.integers(-2 ** 63, 2 ** 63 - 1)),
              presence_penalty=draw(real(-2, 2)), frequency_penalty=draw(real(-2, 2)),
              repetition_penalty=draw(real(0.5, 2)), max_tokens=max_tokens,
              min_tokens=draw(st.integers(0, max_tokens)),
              stop=draw(st.none() | st.lists(st.text(min_size=1, max_size=3), max_size=2) | st.just(STOPS_AT_BOUND)),
              stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=5)),
              ignore_eos=draw(st.booleans()), logprobs=draw(st.none() | st.integers(0, 5)))
    prompt = draw(st.text(min_size=1, max_size=30) | st.lists(st.integers(0, V - 1), min_size=1, max_size=20)
                  | st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.integers(0, V - 1), min_size=1,
                                                                                   max_size=20)))
    return kw, prompt


# field -> values that make an otherwise valid request invalid (ValueError naming that field)
BAD = {
    "n": [0, -1, True, 1.5],
    "temperature": [-0.1, math.nan, math.inf, True, "1", 1e39],
    "top_p": [0, 1.1, math.nan],
    "top_k": [-2, V + 1, 2 ** 31, 2 ** 40, True, 3.0],
    "min_p": [-0.1, 1.1, math.nan],
    "seed": [1.5, True, "3", 2 ** 63, -2 ** 63 - 1, 2 ** 70, -2 ** 70],
    "presence_penalty": [2.1, math.nan, -math.inf],
    "repetition_penalty": [0, -1, math.inf],
    "max_tokens": [0, -3, 2.0, True, L],
    "min_tokens": [-1, True, MAX_TOKENS + 1],
    "stop": ["", [""], ["ok", 3], ["\ud800"], 5, ["s"] * 10_000, STOPS_AT_BOUND + ["x"], "z" * (MAX_STOP_CHARS + 1),
             STOPS_AT_BOUND[:-1] + [STOPS_AT_BOUND[-1] + "z"]],
    "stop_token_ids": [[V], [-1], [True], [2 ** 31], [1.0], list(range(3, 3 + NUM_BANNED + 1))],
    "logprobs": [-1, 21, True],
    "ignore_eos": [1, "yes"],
    "prompt": ["\ud800x", "", [], [V], [-1], [True], [1.0], {"x": [1]}, 3.5, [5] * L],
}


def make_invalid(req, field, value):
    kw, prompt = dict(req[0]), req[1]
    if field == "prompt":
        prompt = value
    else:
        kw[field] = value
    if field == "stop_token_ids" and len(value) > 1:
        kw.update(min_tokens=1, max_tokens=MAX_TOKENS)  # too many ids to ban until min_tokens
    if field == "min_tokens":
        kw["max_tokens"] = MAX_TOKENS
    return kw, prompt


def run_to_end(engine, rid):
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                last = o
    return last


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=valid_requests())
def test_valid_requests_complete(engine, req):
    kw, prompt = req
    out = run_to_end(engine, engine.add_request(None, prompt, SamplingParams(**kw)))
    assert out is not None and out.finished and len(out.outputs) == kw["n"]
    for c in out.outputs:
        assert c.finish_reason in ("stop", "length") and kw["min_tokens"] <= len(c.token_ids) <= kw["max_tokens"]
        assert all(0 <= t < V for t in c.token_ids)
        assert (c.logprobs is None) == (kw["logprobs"] is None)
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.parametrize("field,value", [(f, v) for f in BAD for v in BAD[f]],
                         ids=lambda v: repr(v)[:40])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: the failing field is known
@given(req=valid_requests(), keep=valid_requests())
def test_invalid_requests_raise_naming_the_field(engine, field, value, req, keep):
    """A valid request is in flight meanwhile; the bad one leaves it (and the engine) unharmed."""
    kw, prompt = make_invalid(req, field, value)
    ok = engine.add_request(None, keep[1], SamplingParams(**keep[0]))
    try:
        with pytest.raises(ValueError) as e:
            engine.add_request(None, prompt, SamplingParams(**kw))
        assert isinstance(e.value, InvalidParam) and e.value.param == field, (field, str(e.value))
        assert len(engine.groups) == 1  # nothing of the bad request was queued
        out = run_to_end(engine, ok)
        assert out.finished and all(c.finish_reason in ("stop", "length") for c in out.outputs)
    finally:  # a failing example must not leave work behind for the next ones
        for rid in list(engine.groups):
            engine.abort_request(rid)
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_waiting"] == s["num_running"] == 0
