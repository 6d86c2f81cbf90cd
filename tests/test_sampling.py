"""Sampling, stop conditions, logprobs, detokenization, bad input."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxpaged.step.sampler import _filter, _penalize
from jaxpaged.testing.sampled import filtered_softmax, tv, tv_bound
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok_model"))
    make_tiny_model(path, "llama", vocab_size=320, seed=3, initializer_range=0.3)
    add_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(tok_model, engine_kwargs):
    return LLM(model=tok_model, **engine_kwargs)


def _gen(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    p = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    kw = dict(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = _gen(llm, [p], **kw)[0].outputs[0].token_ids
    again = _gen(llm, [p], **kw)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 40, 17)]
    params = [SamplingParams(max_tokens=25, temperature=0.7, seed=i, ignore_eos=True) for i in range(3)]
    mixed = llm.generate(others[:2] + [p] + others[2:], params[:2] + [SamplingParams(**kw)] + params[2:],
                         use_tqdm=False)
    assert alone == again == mixed[2].outputs[0].token_ids
    other_seed = _gen(llm, [p], **{**kw, "seed": 99})[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_samples_share_prompt_blocks(llm):
    p = {"prompt_token_ids": list(range(3, 3 + 40))}
    out = _gen(llm, [p], n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = _gen(llm, [p], n=2, max_tokens=8, temperature=0, ignore_eos=True)[0]
    single = _gen(llm, [p], max_tokens=8, temperature=0, ignore_eos=True)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == single.outputs[0].token_ids
    # sample 1 admitted after sample 0's prompt: it holds sample 0's two full blocks
    eng = llm.engine
    eng.add_request("share", p, SamplingParams(n=2, max_tokens=4, temperature=0, ignore_eos=True))
    while not all(r.status.value == "running" for r in eng.groups["share"].samples):
        eng.step()
    a, b = eng.groups["share"].samples
    assert a.block_ids[:2] == b.block_ids[:2]
    while eng.has_unfinished_requests():
        eng.step()


def test_stop_strings_stop_ids_min_max_tokens(llm):
    p = "The quick brown"
    base = _gen(llm, [p], max_tokens=30, temperature=0, ignore_eos=True)[0].outputs[0]
    text, ids = base.text, base.token_ids
    assert len(text) > 6
    stop = text[3:6]
    o = _gen(llm, [p], max_tokens=30, temperature=0, ignore_eos=True, stop=[stop, "\x00never"])[0].outputs[0]
    assert o.text == text[:text.index(stop)] and o.finish_reason == "stop"
    k = 4
    sid = ids[k]
    o = _gen(llm, [p], max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[sid])[0].outputs[0]
    assert o.token_ids == ids[:ids.index(sid) + 1] and o.finish_reason == "stop"
    o = _gen(llm, [p], max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[sid],
             min_tokens=12)[0].outputs[0]
    assert len(o.token_ids) >= 12 and sid not in o.token_ids[:12]
    o = _gen(llm, [p], max_tokens=7, temperature=0, ignore_eos=True)[0].outputs[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "length"


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    for _ in range(40):  # find a prompt whose greedy continuation reaches EOS
        p = {"prompt_token_ids": [int(t) for t in rng.integers(3, 300, size=8)]}
        ids = _gen(llm, [p], max_tokens=40, temperature=0, ignore_eos=True)[0].outputs[0].token_ids
        if eos in ids:
            break
    else:
        pytest.skip("no EOS in 40 random prompts")
    o = _gen(llm, [p], max_tokens=40, temperature=0)[0].outputs[0]
    assert o.token_ids == ids[:ids.index(eos) + 1] and o.finish_reason == "stop"


def test_logprobs_are_consistent(llm):
    o = _gen(llm, ["Hello"], max_tokens=5, temperature=0.8, seed=3, logprobs=4, ignore_eos=True)[0].outputs[0]
    assert len(o.logprobs) == 5
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert tok in lp and len(lp) in (4, 5)
        vals = sorted(lp.values(), reverse=True)
        assert all(v <= 0 for v in vals) and np.exp(vals).sum() <= 1 + 1e-5


def test_penalties_against_hand_computation():
    V = 6
    logits = jnp.array([[1.0, -2.0, 0.5, 3.0, 0.0, -1.0]])
    h = dict(history=jnp.array([[0, 3, 3, 1, -1]]), prompt_len=jnp.array([1]), history_len=jnp.array([4]),
             repetition_penalty=jnp.array([2.0]), frequency_penalty=jnp.array([0.5]),
             presence_penalty=jnp.array([0.25]))
    got = np.asarray(_penalize(logits, h))[0]
    # prompt token 0, outputs 3, 3, 1. repetition on {0,1,3}; frequency/presence on outputs only
    want = np.array([1.0 / 2, -2.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 1.0 - 0.25, 0.0, -1.0])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.shape == (V,)


def test_top_k_top_p_min_p_filter():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1], [0.5, 0.25, 0.15, 0.1], [0.5, 0.25, 0.15, 0.1]]))
    sp = dict(top_k=jnp.array([2, 0, 0]), top_p=jnp.array([1.0, 0.7, 1.0]), min_p=jnp.array([0.0, 0.0, 0.4]))
    kept = np.isfinite(np.asarray(_filter(logits, sp)))
    assert kept.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]


def test_top_p_over_what_top_k_and_min_p_keep():
    """top_p counts the mass of the tokens top_k and min_p keep, renormalised (vLLM's and Tunix's order): over
    the whole vocabulary 0.4 comes before the second token (< 0.5 and < 0.55: kept); over the top 2, or over the
    tokens with p >= 0.6 * 0.4, 0.57 does (dropped)."""
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    sp = dict(top_k=jnp.array([0, 2, 0]), top_p=jnp.array([0.5, 0.5, 0.55]), min_p=jnp.array([0.0, 0.0, 0.6]))
    kept = np.isfinite(np.asarray(_filter(logits, sp)))
    assert kept.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]


def test_sampled_first_tokens_follow_the_filtered_softmax(llm):
    """Temperature, top-k and top-p through LLM.generate: the first tokens of N seeded requests (one generate call)
    follow the exact filtered softmax of the prompt's next-token log-probabilities, read from a greedy
    request's raw logprobs (the top 20: each setting keeps at most those); total variation under the bound of
    N draws (a false alarm with probability < 1e-6)."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    lp = _gen(llm, [prompt], max_tokens=1, temperature=0, logprobs=20)[0].outputs[0].logprobs[0]
    logits = np.full(320, -np.inf)  # [V] log p of the top 20, -inf elsewhere
    logits[list(lp)] = list(lp.values())
    n, settings = 600, ((1.0, 0.6, 20), (1.0, 1.0, 3), (0.3, 1.0, 20))  # (temperature, top_p, top_k)
    params = [SamplingParams(max_tokens=1, temperature=t, top_p=p, top_k=k, seed=1000 * j + i, ignore_eos=True)
              for j, (t, p, k) in enumerate(settings) for i in range(n)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for j, (t, p, k) in enumerate(settings):
        want = filtered_softmax(logits, t, p, k)
        bound = tv_bound(want, n)
        # the check has power: greedy decoding, no top-p / top-k, or temperature 1, would be further than the bound
        others = [filtered_softmax(logits, t, 1.0, 20), filtered_softmax(logits, 1.0, p, k)]
        assert 1 - want.max() > 2 * bound, (want.max(), bound)
        assert all(np.abs(o - want).sum() / 2 > 2 * bound for o in others if not np.array_equal(o, want))
        got = np.array([o.outputs[0].token_ids[0] for o in outs[j * n:(j + 1) * n]])
        assert set(got.tolist()) <= set(np.flatnonzero(want).tolist()), (t, p, k)  # only kept tokens
        assert tv(got, want) < bound, (t, p, k, tv(got, want), bound)


def test_incremental_detokenizer_multibyte(tok_model):
    tok = Tokenizer.from_dir(tok_model)
    text = "café 東京 😀 naïve"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], [])
    seen = []
    for t in ids:
        d.add(t)
        seen.append(d.text)
        assert "\ufffd" not in d.text and text.startswith(d.text)
    assert d.text == text


def test_detokenizer_remembered_steps_equal_decoding_each_window(tok_model):
    """The detokenizer's remembered two-token steps (`Tokenizer.step_text`) give the text of decoding every
    window afresh (the algorithm without any memo), on ids that split characters and include special ones."""
    tok = Tokenizer.from_dir(tok_model)
    rng = np.random.default_rng(1)
    pool = tok.encode("café 東京 😀 naïve. the end") + list(range(0, 40))
    for skip in (True, False):
        for trial in range(30):
            prompt = [int(t) for t in rng.choice(pool, rng.integers(0, 8))]
            out = [int(t) for t in rng.choice(pool, 40)]
            d = IncrementalDetokenizer(tok, prompt, [], skip)
            ids, p, r, text = list(prompt[-6:]), 0, len(prompt[-6:]), ""  # the same algorithm, no memo
            for t in out:
                d.add(t)
                ids.append(t)
                prefix, full = tok.decode(ids[p:r], skip), tok.decode(ids[p:], skip)
                if len(full) > len(prefix) and not full.endswith("\ufffd"):
                    text, p, r = text + full[len(prefix):], r, len(ids)
                assert d.text == text, (skip, trial, ids)


def test_detokenizer_caught_up_late_equals_token_by_token(tok_model):
    """A detokenizer that falls behind (a request not streamed) and catches up at any point has the text
    and stop decisions of one fed every token; it stops at a token not read back yet (negative)."""
    tok = Tokenizer.from_dir(tok_model)
    rng = np.random.default_rng(0)
    for trial in range(20):
        prompt = [int(t) for t in rng.integers(0, 300, rng.integers(1, 9))]
        out = tok.encode("café 東京 😀 naïve. the end")[:rng.integers(1, 12)] + \
            [int(t) for t in rng.integers(0, 300, 30)]  # random ids: special ones, split characters
        stop = [] if trial % 2 else ["e", "東"]
        each, late = (IncrementalDetokenizer(tok, prompt, stop) for _ in range(2))
        ids, texts, hits = list(prompt), [], []
        for t in out:
            ids.append(t)
            hits.append(each.catch_up(ids))
            texts.append(each.text)
            if hits[-1]:
                break
        cuts = sorted({int(c) for c in rng.integers(1, len(texts) + 1, 3)} | {len(texts)})
        for c in cuts:
            assert late.catch_up(prompt + out[:c] + [-1, 7]) == hits[c - 1]  # -1: still on the device
            assert late.text == texts[c - 1] and late.next == len(prompt) + c


def test_stop_strings_of_mixed_lengths_cut_at_the_first_match(tok_model):
    """Each stop string is searched only where a match of it would end in the new text: the text still
    stops at the first token after which the text holds any of them, cut before the earliest, however long
    the others are (against the whole text after each token)."""
    tok = Tokenizer.from_dir(tok_model)
    rng = np.random.default_rng(2)
    ids = tok.encode("the cat sat on the mat; café 東京 naïve, the end of the cat story " * 3)
    whole, texts = IncrementalDetokenizer(tok, [], []), []
    for t in ids:
        whole.add(t)
        texts.append(whole.text)
    for trial in range(40):
        picks = [int(i) for i in rng.integers(0, len(texts[-1]) - 1, rng.integers(1, 5))]
        stop = [texts[-1][i:i + int(rng.integers(1, 40))] for i in picks]  # lengths 1 to 39, mixed
        k = next(k for k, x in enumerate(texts) if any(s in x for s in stop))
        want = texts[k][:min(texts[k].find(s) for s in stop if s in texts[k])]
        d = IncrementalDetokenizer(tok, [], stop)
        assert [d.add(t) for t in ids[:k + 1]] == [False] * k + [True] and d.text == want, (stop, d.text)


def test_streamed_outputs_are_snapshots_and_final_only_the_same(llm):
    """Each streamed output keeps the tokens and text it had when it was returned (they are copied only
    when read); a request added with stream=False returns only its final output, equal to the streamed one."""
    eng = llm.engine
    kw = dict(max_tokens=24, temperature=0.8, seed=5, logprobs=2, ignore_eos=True)
    eng.add_request("s", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(**kw))
    eng.add_request("f", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(**kw), stream=False)
    outs = {"s": [], "f": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
    assert len(outs["f"]) == 1 and outs["f"][0].finished and len(outs["s"]) == 24
    final = outs["s"][-1].outputs[0]
    assert (outs["f"][0].outputs[0].token_ids, outs["f"][0].outputs[0].text) == (final.token_ids, final.text)
    assert outs["f"][0].outputs[0].logprobs == final.logprobs
    for i, o in enumerate(outs["s"]):  # read only now, after the request went on
        c = o.outputs[0]
        assert c.token_ids == final.token_ids[:i + 1] and len(c.logprobs) == i + 1
        assert final.text.startswith(c.text) and o.finished == (i == 23)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(min_p=2), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=[""]), "stop"), (dict(logprobs=-1), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    eng = llm.engine
    eng.add_request("ok", "Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, match in [("", "empty"), ({"prompt_token_ids": []}, "empty"),
                          ({"prompt_token_ids": [1, 400]}, "out of vocabulary"),
                          ({"prompt_token_ids": [5] * 300}, "max_model_len"), (3.5, "prompt must be"),
                          ({"text": "x"}, "prompt_token_ids")]:
        with pytest.raises(ValueError, match=match):
            eng.add_request(None, prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request(None, [5] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", "Hi")
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request(None, "Hi", SamplingParams(logprobs=1000))
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(done[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="prompt_token_ids"):  # generate validates all before running any
        llm.generate(["fine", {"bad": 1}], SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests()


def test_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    eng.abort_request("a")
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished_requests()


def test_bad_model_dirs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read config"):
        LLM(model=str(tmp_path))


def test_penalties_through_the_engine_without_recompiling(llm):
    n0 = llm.stats()["num_compilations"]
    p = {"prompt_token_ids": [5, 6, 7, 5, 6, 7]}
    plain = _gen(llm, [p], max_tokens=30, temperature=0, ignore_eos=True)[0].outputs[0].token_ids
    pen = _gen(llm, [p], max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.8,
               frequency_penalty=1.5)[0].outputs[0].token_ids
    assert pen != plain and len(set(pen)) >= len(set(plain))
    assert llm.stats()["num_compilations"] == n0
