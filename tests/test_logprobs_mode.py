"""logprobs_mode: raw / processed logprobs and logits, checked against a float64 recomputation of the
sampler's distribution from the raw logits (the whole vocabulary asked for, so nothing is hidden)."""
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams

V = 256  # jaxpaged/testing/tiny_models.py's tiny vocabulary
PROMPT = {"prompt_token_ids": [3, 17, 9, 44, 3, 101, 17]}
CASES = [  # every processing step the sampler has, a few at a time
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.05, logit_bias={5: 2.0, 9: -3.0}, presence_penalty=0.5,
         repetition_penalty=1.2),
    dict(temperature=0.0, frequency_penalty=0.4, min_tokens=3, stop_token_ids=[7]),
    dict(temperature=1.0, allowed_token_ids=list(range(0, 256, 3))),
]


@pytest.fixture(scope="module")
def engines(tiny_models, engine_kwargs):
    kw = dict(engine_kwargs, max_logprobs=V, warmup=False)  # one bucket used: compile only it
    return {mode: LLM(model=tiny_models["llama"], logprobs_mode=mode, **kw)
            for mode in ("raw_logits", "processed_logprobs", "processed_logits")}


def _reference(z, case, history, prompt_len, num_out):
    """float64 processed logits of one position: z f64[V] raw logits; history: prompt + output so far."""
    z = z.copy()
    for t, b in (case.get("logit_bias") or {}).items():
        z[t] += b
    if case.get("allowed_token_ids"):
        keep = np.zeros(V, bool)
        keep[case["allowed_token_ids"]] = True
        z[~keep] = -np.inf
    out = np.bincount(np.array(history[prompt_len:], int), minlength=V)
    seen = np.bincount(np.array(history, int), minlength=V) > 0
    rep = case.get("repetition_penalty", 1.0)
    z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
    z = z - case.get("frequency_penalty", 0.0) * out - case.get("presence_penalty", 0.0) * (out > 0)
    if num_out < case.get("min_tokens", 0):
        z[case.get("stop_token_ids", [])] = -np.inf
    temp = case["temperature"]
    if temp == 0:
        return z
    z = z / temp
    srt = np.sort(z)[::-1]
    thresh = srt[case["top_k"] - 1] if case.get("top_k") else -np.inf
    if case.get("top_p", 1.0) < 1.0:
        p = np.exp(srt - srt[0])
        p /= p.sum()
        before = np.cumsum(p) - p
        thresh = max(thresh, srt[max((before < case["top_p"]).sum(), 1) - 1])
    if case.get("min_p"):
        thresh = max(thresh, srt[0] + np.log(case["min_p"]))
    return np.where(z >= thresh, z, -np.inf)


def _log_softmax(z):
    m = z[np.isfinite(z)].max()
    return z - (m + np.log(np.exp(z[np.isfinite(z)] - m).sum()))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_processed_logprobs_equal_float64_recomputation(engines, case):
    kw = dict(CASES[case], max_tokens=8, seed=11 + case, ignore_eos=True, logprobs=V)
    outs = {m: llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
            for m, llm in engines.items()}
    ids = outs["raw_logits"].token_ids
    assert outs["processed_logprobs"].token_ids == outs["processed_logits"].token_ids == ids
    history = list(PROMPT["prompt_token_ids"])
    for i, tok in enumerate(ids):
        raw = np.full(V, np.nan)
        for t, v in outs["raw_logits"].logprobs[i].items():
            raw[t] = v
        assert not np.isnan(raw).any()  # all V logits came back
        proc = _reference(raw.astype(np.float64), CASES[case], history, len(PROMPT["prompt_token_ids"]), i)
        assert np.isfinite(proc[tok])  # the token was drawn from the processed distribution
        for mode, want in (("processed_logits", proc), ("processed_logprobs", _log_softmax(proc))):
            got = outs[mode].logprobs[i]
            assert set(got) == set(range(V))
            g = np.array([got[t] for t in range(V)])
            assert np.array_equal(np.isinf(g), np.isinf(want)), (mode, i)
            fin = np.isfinite(want)
            np.testing.assert_allclose(g[fin], want[fin], rtol=0, atol=1e-5, err_msg=f"{mode} token {i}")
        history.append(tok)


def test_raw_logprobs_are_log_softmax_of_raw_logits(engines, tiny_models, engine_kwargs):
    kw = dict(temperature=0.8, top_k=5, max_tokens=4, seed=3, ignore_eos=True, logprobs=V)
    raw_llm = LLM(model=tiny_models["llama"], **dict(engine_kwargs, max_logprobs=V, warmup=False))  # raw_logprobs
    lp = raw_llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    lg = engines["raw_logits"].generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    assert lp.token_ids == lg.token_ids
    for a, b in zip(lp.logprobs, lg.logprobs):
        z = np.array([b[t] for t in range(V)], np.float64)
        np.testing.assert_allclose([a[t] for t in range(V)], _log_softmax(z), rtol=0, atol=1e-5)


def test_bad_logprobs_mode_names_the_field(tiny_models):
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(model=tiny_models["llama"], logprobs_mode="softmax")
