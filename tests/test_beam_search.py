"""Beam search (issue #36): `LLM.beam_search` against a brute-force beam search over Hugging Face's logits
(vLLM's rules: the top 2 * beam_width candidates of each beam, ranked by cumulative logprob, EOS-finished
beams kept aside, the end ranked by get_beam_search_score), with forks sharing blocks through the prefix
cache (no prompt recomputed), a small pool (cached prefixes evicted), and every block free at the end.

One engine for the module: blocks of 8 tokens, a 32-token budget (long prompts are chunked), 8 slots and a
pool of 14 blocks (three prompts' beams do not fit at once). The tiny model's EOS is one of the first step's likely
tokens, so that EOS-finished beams happen."""
import json
import os

import numpy as np
import pytest
from oracle import hf_model

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from jaxpaged.core.beam_search import BeamSearch, get_beam_search_score
from jaxpaged.testing.tiny_models import make_tiny_model

BLOCK = 8
PROMPTS = [[5, 9, 23, 40, 7], [int(t) for t in np.random.default_rng(1).integers(3, 256, 17)],
           [int(t) for t in np.random.default_rng(2).integers(3, 256, 40)]]


def hf_logprobs(path, tokens):
    import torch
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([tokens])).logits[0, -1].double()
    return torch.log_softmax(logits, -1).numpy()


def brute_force(path, prompt, width, max_tokens, eos, ignore_eos=False, length_penalty=1.0):
    """vLLM's beam search, written plainly over HF's full distributions: [(tokens, cum_logprob)], best first."""
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in beams:
            lp = hf_logprobs(path, toks)
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                (done if t == eos and not ignore_eos else cands).append((toks + [int(t)], cum + float(lp[t])))
        beams = sorted(cands, key=lambda c: -c[1])[:width]
        if not beams:
            break

    def score(s):
        return s[1] / (len(s[0]) - (s[0][-1] == eos)) ** length_penalty
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny llama whose EOS is the third likeliest first token of PROMPTS[0]."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("beam") / "llama"), "llama", seed=7)
    eos = int(np.argsort(-hf_logprobs(path, PROMPTS[0]))[2])
    for name in ("config.json", "generation_config.json"):
        f = os.path.join(path, name)
        if os.path.exists(f):
            with open(f) as fh:
                cfg = json.load(fh)
            cfg["eos_token_id"] = eos
            with open(f, "w") as fh:
                json.dump(cfg, fh)
    return path, eos


@pytest.fixture(scope="module")
def llm(model, engine_kwargs):
    kw = dict(engine_kwargs, block_size=BLOCK, max_num_batched_tokens=32, num_kv_blocks=14)
    return LLM(model=model[0], **kw)


def tail(n: int) -> int:
    """The tokens a beam of n tokens computes when its parent's full blocks are cached: those after its
    last full block that does not hold its last token (1 to BLOCK)."""
    return n - BLOCK * ((n - 1) // BLOCK)


def all_free(llm):
    eng = llm.engine
    s = llm.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert not any(eng.block_manager.ref_count), "a block is still referenced"


def check(llm, model, prompts, width, max_tokens, **kw):
    path, eos = model
    got = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                          BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kw))
    assert len(got) == len(prompts)
    for p, out in zip(prompts, got):
        want = brute_force(path, p, width, max_tokens, eos, kw.get("ignore_eos", False), kw.get("length_penalty", 1.0))
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences], [w[1] for w in want], atol=1e-3)
        for s in out.sequences:
            assert s.tokens[:len(p)] == p and len(s.logprobs) == len(s.tokens) - len(p)
            ended = s.tokens[-1] == eos and not kw.get("ignore_eos")
            assert s.finish_reason == ("stop" if ended else "length")
    all_free(llm)
    return got


def test_width_1_is_greedy(llm, model):
    got = check(llm, model, PROMPTS, 1, 6, ignore_eos=True)
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, b, g in zip(PROMPTS, got, greedy):
        assert b.sequences[0].tokens == p + list(g.outputs[0].token_ids)


@pytest.mark.parametrize("width", [2, 4])
def test_matches_brute_force(llm, model, width):
    got = check(llm, model, PROMPTS, width, 7)
    if width == 2:  # PROMPTS[0]'s EOS is a first-step candidate: a beam finished on it is kept and ranked
        assert any(s.finish_reason == "stop" for s in got[0].sequences)


@pytest.mark.parametrize("kw", [dict(ignore_eos=True), dict(length_penalty=0.0), dict(length_penalty=2.0)])
def test_options(llm, model, kw):
    check(llm, model, PROMPTS[:2], 3, 5, **kw)


def test_small_pool_evicts_and_recomputes(llm, model):
    """Three prompts of 40 tokens x 4 beams: 12 requests an iteration for 8 slots and 13 blocks, long
    prefills chunked by the 32-token budget. The pool cannot hold every prompt's cached blocks, so forks
    find their parent's prefix evicted and recompute it (more tokens than with every prefix cached), and the
    beams do not change. (A beam's step is one token: its request never grows after its prefill, so the
    scheduler's preemption path is not reached by beam search; see tests/test_host.py for it.)"""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 256, 40)] for _ in range(3)]
    llm.engine.block_manager.reset_prefix_cache()
    before = llm.stats()["iteration_tokens"]["sum"]
    check(llm, model, prompts, 4, 6, ignore_eos=True)
    computed = llm.stats()["iteration_tokens"]["sum"] - before
    assert computed > 3 * 40 + sum(3 * 4 * tail(40 + t) for t in range(1, 6))


def test_forks_do_not_recompute_the_prompt(llm, model):
    """One prompt of 40 tokens, 3 beams, 9 tokens: after the prompt's first step, each beam's step computes
    only the tokens after its last full block (<= BLOCK), never the prompt."""
    prompt = [int(t) for t in np.random.default_rng(9).integers(3, 256, 40)]
    llm.engine.block_manager.reset_prefix_cache()
    eng, scheduled = llm.engine, []
    schedule = eng.schedule

    def counting():  # the tokens each step computes (its schedule's num_tokens)
        out = schedule()
        scheduled.append(out.num_tokens)
        return out
    eng.schedule = counting
    try:
        out = check(llm, model, [prompt], 3, 9, ignore_eos=True)
    finally:
        del eng.schedule
    computed = sum(scheduled)
    bound = len(prompt) + sum(3 * tail(len(prompt) + t) for t in range(1, 9))
    # exactly: the prompt once, then each beam its tail (a beam re-running the prompt would add >= 32)
    assert computed == bound
    assert len(out[0].sequences) == 3


def test_refused_when_the_engine_cannot_run_it(llm):
    with pytest.raises(ValueError, match="beam_width"):  # 2 * 11 logprobs a step > max_logprobs 20
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="prompt"):
        llm.beam_search([[5, 999]], BeamSearchParams(beam_width=2, max_tokens=2))  # out of the vocabulary
    all_free(llm)


def test_core_rules():
    """Host rules alone: EOS candidates finish (score without the EOS), max_model_len ends beams, the
    server's generated ids drop a finishing EOS unless include_stop_str_in_output."""
    assert get_beam_search_score([1, 2, 3, 9], -2.0, 9, 1.0) == -2.0 / 3
    assert get_beam_search_score([1, 2, 3, 9], -2.0, {4}, 2.0) == -2.0 / 16
    s = BeamSearch([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=5), {9}, max_model_len=4)
    s.advance([{9: -0.1, 5: -0.5, 6: -1.0}])
    assert [b.tokens for b in s.instances[0].beams] == [[1, 2, 5], [1, 2, 6]]
    s.advance([{7: -0.2}, {8: -0.1}])  # length 4 = max_model_len: every beam ends
    assert s.done
    best = s.best()[0]
    assert [b.tokens for b in best] == [[1, 2, 9], [1, 2, 5, 7]] and best[0].finish_reason == "stop"
    assert s.generated(0, best[0]) == [] and s.generated(0, best[1]) == [5, 7]
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=1)


def test_matches_hf_generate_without_eos(llm, model):
    """HF transformers' own beam search (num_beams=k, the top 2k candidates over all beams) agrees where its
    stopping rules and vLLM's coincide: EOS ignored, every beam max_tokens long."""
    import torch
    path, _ = model
    hf = hf_model(path)
    for p in PROMPTS[:2]:
        got = llm.beam_search([{"prompt_token_ids": p}], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), num_beams=3, num_return_sequences=3, do_sample=False,
                               max_new_tokens=5, early_stopping=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert [s.tokens for s in got[0].sequences] == want.tolist()
    all_free(llm)


def _toy_logprobs(tokens, vocab=12):
    """A deterministic 'model' over a 12-token vocabulary: log-softmax of logits seeded by the prefix."""
    rng = np.random.default_rng(abs(hash(tuple(tokens))) % 2 ** 32)
    x = rng.normal(size=vocab) * 2
    return x - np.log(np.exp(x).sum())


def _toy_brute_force(prompt, width, max_tokens, eos, ignore_eos, length_penalty, max_model_len):
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(min(max_tokens, max_model_len - len(prompt))):
        cands = []
        for toks, cum in beams:
            lp = _toy_logprobs(toks)
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                (done if t == eos and not ignore_eos else cands).append((toks + [int(t)], cum + float(lp[t])))
        beams = sorted(cands, key=lambda c: -c[1])[:width]
        if not beams:
            break
    return sorted(done + beams, key=lambda s: get_beam_search_score(s[0], s[1], eos, length_penalty),
                  reverse=True)[:width]


@pytest.mark.parametrize("seed", range(12))
def test_core_against_brute_force_on_a_toy_model(seed):
    """The host rules alone, many shapes: widths, EOS on or ignored, length penalties, max_model_len cuts."""
    rng = np.random.default_rng(seed)
    width, max_tokens = int(rng.integers(1, 5)), int(rng.integers(1, 7))
    prompts = [[int(t) for t in rng.integers(3, 12, int(rng.integers(1, 5)))] for _ in range(int(rng.integers(1, 4)))]
    ignore_eos, lp = bool(rng.integers(2)), float(rng.choice([0.0, 0.5, 1.0, 2.0]))
    max_model_len = int(rng.integers(3, 12))
    prompts = [p for p in prompts if len(p) < max_model_len] or [[5]]
    s = BeamSearch(prompts, BeamSearchParams(width, max_tokens, ignore_eos=ignore_eos, length_penalty=lp), {2},
                   max_model_len)
    while not s.done:
        top = []
        for _, toks in s.pending():
            lps = _toy_logprobs(toks)
            top.append({int(t): float(lps[t]) for t in np.argsort(-lps, kind="stable")[:2 * width]})
        s.advance(top)
    for p, got in zip(prompts, s.best()):
        want = _toy_brute_force(p, width, max_tokens, 2, ignore_eos, lp, max_model_len)
        assert [g.tokens for g in got] == [w[0] for w in want]
        np.testing.assert_allclose([g.cum_logprob for g in got], [w[1] for w in want])


def test_without_the_prefix_cache_one_warning_says_the_prompt_is_recomputed(caplog, monkeypatch):
    import functools
    import logging

    from jaxpaged.core import beam_search
    monkeypatch.setattr(beam_search, "_warn_recompute", functools.cache(beam_search._warn_recompute.__wrapped__))
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    with caplog.at_level(logging.WARNING, logger=beam_search.__name__):
        beam_search.check_beam_search(params, "raw_logprobs", 8, prefix_caching=True)
        assert not caplog.records
        for _ in range(3):
            beam_search.check_beam_search(params, "raw_logprobs", 8, prefix_caching=False)
    assert len(caplog.records) == 1 and "recomputes every beam's prompt" in caplog.records[0].getMessage()
