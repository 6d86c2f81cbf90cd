"""Speculative decoding (jaxpaged/spec_decode/): outputs equal a plain run's, token for token (greedy, and
sampled with a seed), through preemption, chunked prefill, prefix hits and stops inside accepted runs; the
verifier keeps the target distribution (chi-square, with a wrong rule that fails it); the pool holds what
a plain run writes; bad configurations are refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, EngineConfig, SamplingParams
from jaxpaged.spec_decode.ngram import ngram_propose
from jaxpaged.spec_decode.verify import verify_rows

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
V = 320


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model
    path = make_tiny_model(str(tmp_path_factory.mktemp("spec") / "tiny"), "llama", vocab_size=V)
    add_tiny_tokenizer(path, vocab_size=300)
    return path


def _prompts():
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, 300, size=36)]
    loop = [7, 8, 9, 10, 11] * 4  # repeats: n-gram lookup proposes
    prompts = [[int(t) for t in rng.integers(3, 300, size=n)] for n in (1, 6, 17, 40)]
    prompts += [shared + [int(t) for t in rng.integers(3, 300, size=n)] for n in (3, 12)] + [shared, loop]
    return [{"prompt_token_ids": p} for p in prompts]


class AlwaysPropose:
    """A governor that always lets proposals take a larger token bucket (tests need every request to propose
    on every step)."""
    def allow_larger(self, *args):
        return True

    def record(self, *args):
        pass

    def summary(self):
        return {}


class Oracle:
    """Proposes the plain run's continuation with every fifth proposal wrong: runs of acceptance at every
    position, full acceptance, and rejections."""
    def __init__(self, truth):
        self.truth = truth  # prompt tuple -> plain output token ids

    def propose(self, req, k):
        out = self.truth.get(tuple(req.prompt_token_ids), [])
        o = req.num_output_tokens
        return [t if (o + j) % 5 != 4 else (t + 1) % V for j, t in enumerate(out[o:o + k])]

    def retain(self, request_ids):
        pass


def _spec_llm(model, engine_kwargs, proposer=None, **over):
    llm = LLM(model=model, **{**engine_kwargs, "speculative_config": NGRAM, **over})
    llm.engine.spec.governor = AlwaysPropose()
    if proposer is not None:
        llm.engine.spec.proposer = proposer
    return llm


def _tokens(llm, params, prompts=None):
    return [o.outputs[0].token_ids for o in llm.generate(prompts or _prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(model, engine_kwargs):
    llm = LLM(model=model, **engine_kwargs)
    return llm, _tokens(llm, GREEDY), _tokens(llm, SAMPLED)


def _truth(plain_tokens):
    return {tuple(p["prompt_token_ids"]): t for p, t in zip(_prompts(), plain_tokens)}


def _all_blocks_free(llm):
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_ngram_proposals():
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3], np.int32)
    assert ngram_propose(t, 3, 2, 5).tolist() == [7, 2, 3]       # the most recent match of "2 3"
    t = np.array([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3], np.int32)
    assert ngram_propose(t, 2, 2, 5).tolist() == [4, 9]          # "1 2 3" (longest) wins over "2 3"
    assert ngram_propose(t, 2, 4, 5).tolist() == []              # no 4-gram recurs
    assert ngram_propose(np.array([5], np.int32), 2, 1, 5).tolist() == []
    t = np.array([4, 9, 5, 7, 4], np.int32)
    assert ngram_propose(t, 2, 1, 3).tolist() == [9, 5]          # n = 1: the last token alone
    assert ngram_propose(t, 2, 2, 3).tolist() == []


def test_ngram_greedy_equals_plain(model, engine_kwargs, plain):
    llm = _spec_llm(model, engine_kwargs)
    assert _tokens(llm, GREEDY) == plain[1]
    st = llm.engine.stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_draft_tokens"] >= st["spec_decode_num_drafts"]
    _all_blocks_free(llm)


class NeverLarger(AlwaysPropose):
    """A governor that never lets proposals take a larger token bucket than the step's decodes alone."""
    def allow_larger(self, *args):
        return False


def test_proposals_within_padding_and_the_plain_variant(model, engine_kwargs, plain):
    """Where the governor refuses a larger bucket, requests still propose into the bucket's padding (outputs
    unchanged); a step in which some request proposes runs the verifying variant, any other the plain one."""
    llm = _spec_llm(model, engine_kwargs)
    llm.engine.spec.governor = NeverLarger()
    runner, steps = llm.engine.runner, []
    assert sorted(runner.variants()) == sorted((t, False, v) for t in runner.buckets for v in (False, True))
    launch = runner.launch

    def spy(out, *args, **kwargs):
        step = launch(out, *args, **kwargs)
        proposed = sum(len(req.spec_token_ids) for req, _ in out.scheduled)
        steps.append((runner.bucket_for(out.num_tokens), runner.bucket_for(out.num_tokens - proposed),
                      proposed, step.key[2]))
        return step
    runner.launch = spy
    assert _tokens(llm, GREEDY, _prompts()[3:]) == plain[1][3:]  # 5 requests: 3 rows of padding in bucket 8
    assert all(bucket == without for bucket, without, _, _ in steps)  # never a larger bucket
    assert all(verified == (proposed > 0) for *_, proposed, verified in steps)
    assert any(v for *_, v in steps) and not all(v for *_, v in steps)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("over", [dict(), dict(num_kv_blocks=12, max_num_batched_tokens=16)],
                         ids=["plain-paths", "preemption+chunked+prefix"])
def test_verified_runs_equal_plain(model, engine_kwargs, plain, over):
    """Proposals accepted at every position, wholly and partly: greedy and seeded sampling unchanged."""
    llm_g = _spec_llm(model, engine_kwargs, Oracle(_truth(plain[1])), **over)
    assert _tokens(llm_g, GREEDY) == plain[1]
    st = llm_g.engine.stats()
    assert all(n > 0 for n in st["spec_decode_num_accepted_tokens_per_pos"])
    assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]  # rejections too
    if over:
        assert st["num_preemptions"] > 0 and st["prefix_cache_hit_rate"] > 0
    llm_g.engine.spec.proposer = Oracle(_truth(plain[2]))
    assert _tokens(llm_g, SAMPLED) == plain[2]
    _all_blocks_free(llm_g)


def test_stops_inside_accepted_runs(model, engine_kwargs, plain):
    base_llm, greedy, _ = plain
    llm = _spec_llm(model, engine_kwargs, Oracle(_truth(greedy)))
    prompts = _prompts()[:4]
    for kw in (dict(stop_token_ids=[greedy[2][6]]), dict(max_tokens=7),
               dict(min_tokens=9, stop_token_ids=[greedy[3][4]])):
        p = SamplingParams(**{**GREEDY.__dict__, **kw})
        assert _tokens(llm, p, prompts) == _tokens(base_llm, p, prompts), kw
    text = base_llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0].outputs[0].text
    p = SamplingParams(**{**GREEDY.__dict__, "stop": [text[5:8]]})
    a, b = (llm_.generate(prompts[1:2], p, use_tqdm=False)[0].outputs[0] for llm_ in (base_llm, llm))
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    assert b.finish_reason == "stop"
    lp = SamplingParams(**{**SAMPLED.__dict__, "logprobs": 2})
    a, b = (llm_.generate(prompts[:2], lp, use_tqdm=False) for llm_ in (base_llm, llm))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert da.keys() == db.keys() and np.allclose(list(da.values()), list(db.values()), atol=1e-4)
    _all_blocks_free(llm)


def _kv(eng, req, n):
    """f32[L, n, Hkv, hd] of the request's first n positions, K and V stacked on a new first axis."""
    N, bs, L = eng.num_blocks, eng.config.block_size, eng.model_config.num_layers
    pos = np.arange(n)
    blocks = np.asarray(req.block_ids)[pos // bs]
    rows = (np.arange(L)[:, None] * N + blocks[None, :], pos[None, :] % bs)
    return np.stack([np.asarray(eng.runner.k_pool)[rows], np.asarray(eng.runner.v_pool)[rows]])


def test_pool_holds_what_plain_writes(model, engine_kwargs, plain):
    engines = [plain[0].engine, _spec_llm(model, engine_kwargs, Oracle(_truth(plain[1]))).engine]
    prompt = _prompts()[2]
    reqs = []
    for eng in engines:
        eng.add_request("pool", prompt, SamplingParams(**{**GREEDY.__dict__, "max_tokens": 40}))
        req = eng.groups["pool"].samples[0]
        while req.num_output_tokens < 30:
            eng.step()
        reqs.append(req)
    n = min(r.num_computed_tokens for r in reqs)
    assert reqs[0].token_ids[:n] == reqs[1].token_ids[:n] and n >= len(prompt["prompt_token_ids"]) + 29
    np.testing.assert_allclose(_kv(engines[0], reqs[0], n), _kv(engines[1], reqs[1], n), rtol=1e-5, atol=1e-4)
    for eng in engines:
        eng.abort_request("pool")


def _chi2(counts, probs):
    """Pearson's statistic of observed counts against expected probabilities (cells with mass only)."""
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), int(keep.sum()) - 1


def _verify_draws(rule, logits, drafts, R):
    """Run an acceptance rule over R rows (seeds 0..R-1) of the same 2-position logits; return the tokens."""
    K1, Vt = logits.shape
    h = jnp.tile(jnp.asarray(logits), (R, 1))                     # [R*K1, Vt]: "hidden" = logits
    S = R
    batch = dict(logits_indices=jnp.arange(S) * K1 + K1 - 1, sample_slots=jnp.arange(S),
                 draft_tokens=jnp.tile(jnp.asarray(drafts)[None], (S, 1)), num_drafts=jnp.full(S, K1 - 1),
                 min_tokens=jnp.zeros(S, jnp.int32))
    sp = dict(temperature=jnp.ones(S), top_p=jnp.ones(S), top_k=jnp.zeros(S, jnp.int32), min_p=jnp.zeros(S),
              seed=jnp.arange(S, dtype=jnp.uint32), gen_index=jnp.zeros(S, jnp.int32),
              banned=jnp.full((S, 1), -1, jnp.int32), bitmask=jnp.full((S, 1), -1, jnp.int32),
              bias_ids=jnp.full((S, 1), -1, jnp.int32), bias_values=jnp.zeros((S, 1)),
              history=jnp.zeros((S, 1), jnp.int32), prompt_len=jnp.zeros(S, jnp.int32),
              history_len=jnp.zeros(S, jnp.int32), presence_penalty=jnp.zeros(S), frequency_penalty=jnp.zeros(S),
              repetition_penalty=jnp.ones(S), any_penalty=False,
              spec_bitmask=jnp.full((S, K1 - 1, 1), -1, jnp.int32),
              spec_bias_ids=jnp.full((S, K1 - 1, 1), -1, jnp.int32), spec_bias_values=jnp.zeros((S, K1 - 1, 1)),
              any_filter=False, any_mask=False, any_bias=False, all_greedy=False, any_logprobs=False)
    return np.asarray(jax.jit(lambda h: rule(lambda x: x, h, batch, sp, K1 - 1, 1)[0])(h))


def _wrong_rule(logits_fn, h, batch, sp, num_spec, num_logprobs):
    """A classic bug: accept d with probability p(d), but on rejection draw from p itself (not from
    normalize(max(0, p - q))): d is over-represented."""
    tokens, *rest = verify_rows(logits_fn, h, batch, sp, num_spec, num_logprobs)
    p = jax.nn.softmax(h[::num_spec + 1], axis=-1)                # [R, V] position 0
    d = batch["draft_tokens"][:, 0]
    u = jax.random.uniform(jax.random.key(1), d.shape)
    accept = u < p[jnp.arange(d.shape[0]), d]
    first = jnp.where(accept, d, tokens[:, 0])                    # rejected: tokens[:, 0] ~ p, may equal d
    return (tokens.at[:, 0].set(first), *rest)


def test_rejection_sampling_keeps_the_distribution():
    """Over 6000 seeds, position 0's tokens follow p0, and position 1's (where d1 was accepted) follow p1;
    the wrong rule fails the same test (p < 1e-3 critical values)."""
    logits = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0, 0], [0.05, 0.1, 0.5, 0.2, 0.1, 0.05, 0, 0],
                              [0.3, 0.3, 0.1, 0.1, 0.1, 0.1, 0, 0]], np.float32) + 1e-30)
    drafts = np.array([1, 2], np.int32)
    critical = {5: 20.52, 7: 24.32}                              # chi-square, df -> 99.9th percentile
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    toks = _verify_draws(verify_rows, logits, drafts, 6000)      # [R, 3]
    stat, df = _chi2(np.bincount(toks[:, 0], minlength=8), p[0])
    assert stat < critical[df]
    second = toks[toks[:, 0] == drafts[0], 1]
    assert len(second) > 1000
    stat, df = _chi2(np.bincount(second, minlength=8), p[1])
    assert stat < critical[df]
    wrong = _verify_draws(_wrong_rule, logits, drafts, 6000)
    stat, df = _chi2(np.bincount(wrong[:, 0], minlength=8), p[0])
    assert stat > critical[df]


def test_bad_configs_refused(model):
    for cfg, field in [({"method": "nope", "num_speculative_tokens": 2}, "method"),
                       ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 3}, "prompt_lookup_max"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "k"), ("{", "JSON")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=model, speculative_config=cfg)
    for kw in (dict(async_scheduling=True), dict(batch_invariant=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EngineConfig(model=model, speculative_config=NGRAM, **kw)
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}').speculative_config \
        .num_speculative_tokens == 2


def test_metrics_exported():
    from serve.metrics import _EngineCollector

    class Engine:
        def stats(self):
            return dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0,
                        num_preemptions=0, num_step_failures=0, spec_decode_num_drafts=3,
                        spec_decode_num_draft_tokens=9, spec_decode_num_accepted_tokens=5,
                        spec_decode_num_accepted_tokens_per_pos=[3, 2, 0])
    got = {m.name: m.samples for m in _EngineCollector(Engine(), "tiny", 1024).collect()}
    assert got["jaxpaged:spec_decode_num_accepted_tokens"][0].value == 5
    assert [s.value for s in got["jaxpaged:spec_decode_num_accepted_tokens_per_pos"]] == [3, 2, 0]
    assert {"jaxpaged:spec_decode_num_drafts", "jaxpaged:spec_decode_num_draft_tokens"} <= set(got)


def test_governor_takes_a_larger_bucket_where_it_pays():
    """A larger token bucket is taken when the expected accepted tokens outweigh its time: after each bucket
    was measured (the smaller first), E > MARGIN * n * (time(T') / time(T) - 1)."""
    from jaxpaged.spec_decode.governor import MARGIN, WARMUP, Governor
    g = Governor()
    assert not g.allow_larger(16, 16, 32, 100.0)         # the step without it is measured first
    for _ in range(WARMUP):
        g.record(16, 0.040)
    assert g.allow_larger(16, 16, 32, 0.0)               # then the larger one, whatever is expected
    for _ in range(WARMUP):
        g.record(32, 0.060)                              # 1.5x the time: 16 decodes need 8 more tokens, x MARGIN
    assert not g.allow_larger(16, 16, 32, 8 * MARGIN - 0.5) and g.allow_larger(16, 16, 32, 8 * MARGIN + 0.5)
    assert g.allow_larger(4, 16, 32, 2 * MARGIN + 0.5) and not g.allow_larger(4, 16, 32, 2 * MARGIN - 0.5)
    for _ in range(30):
        g.record(32, 0.044)                              # the larger step got cheaper (running average)
    assert g.allow_larger(16, 16, 32, 2.0 * MARGIN)
    assert g.summary()[16]["steps"] == WARMUP and abs(g.summary()[32]["step_seconds"] - 0.044) < 1e-3


def test_request_gate_follows_each_requests_acceptance():
    """RequestGate: a request keeps proposing k while its proposals are accepted, about one more than it
    lately got accepted otherwise, and skips 1, 2, 4 ... steps after proposals rejected whole."""
    from jaxpaged.spec_decode.governor import MAX_SKIP, RequestGate
    gate = RequestGate(4)
    assert gate.proposals("a", 4) == 4 and gate.proposals("b", 4) == 4  # nothing known yet
    gate.record("a", 4, 4)
    assert gate.proposals("a", 4) == 4 and gate.proposals("a", 2) == 2  # never more than asked
    for _ in range(4):  # free text: one of four accepted, again and again
        gate.record("b", 4, 1)
    assert gate.proposals("b", 4) == 2
    assert 1 < gate.expected("b", 4) < 1.5 and gate.expected("a", 4) == 4 and gate.expected("new", 3) == 3
    skips = []
    for _ in range(6):  # rejected whole each time it proposes
        gate.record("b", gate.proposals("b", 4) or 1, 0)
        n = 0
        while gate.proposals("b", 4) == 0:
            n += 1
        skips.append(n)
    assert skips == [1, 2, 4, 8, 16, MAX_SKIP][:6] and MAX_SKIP == 16
    gate.record("b", 1, 1)  # accepted again: no more skipping
    assert gate.proposals("b", 4) >= 1
    gate.retain({"a"})
    assert gate.proposals("b", 4) == 4  # forgotten once it stopped running
