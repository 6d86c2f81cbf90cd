"""Speculative decoding with a draft model (jaxpaged/spec_decode/draft.py, rejection.py): general rejection
sampling keeps the target distribution (chi-square, with wrong acceptance rules that fail it, and in the
engine against plain sampling); greedy with a draft equals greedy without (the target as its own draft:
every proposal accepted; an unrelated draft: almost none), through preemption, chunked prefill and prefix
hits; seeded sampling is reproducible; the metrics count draft proposals; bad drafts are refused by name."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_spec_decode import AlwaysPropose

from jaxpaged import LLM, EngineConfig, SamplingParams
from jaxpaged.spec_decode import rejection
from jaxpaged.spec_decode.rejection import rejection_sample

CRITICAL = {5: 20.52, 6: 22.46, 7: 24.32}  # chi-square, df -> 99.9th percentile


def _chi2(counts, probs):
    """Pearson's statistic of observed counts against expected probabilities (cells with mass only)."""
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum():                                           # tokens the target never draws
        return float("inf"), int(keep.sum()) - 1
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), int(keep.sum()) - 1


def _normalize(x):
    x = np.asarray(x, np.float32)
    return x / x.sum(-1, keepdims=True)


P = _normalize([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0, 0], [0.05, 0.1, 0.5, 0.2, 0.1, 0.05, 0, 0],
                [0.3, 0.3, 0.1, 0.1, 0.1, 0.1, 0, 0]])                 # [K+1, V] the target's, per position
Q = _normalize([[0.1, 0.3, 0.1, 0.3, 0.0, 0.05, 0.15, 0], [0.3, 0.1, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05]])  # [K, V]


def _draws(p, q, R, greedy=False):
    """R rows (seeds 0..R-1): proposals drawn from q with the plain sampler's key per position (as the draft
    does), the target's plain draws from p, then rejection sampling. Returns (tokens [R, K+1], drafts)."""
    K1, V = p.shape
    seed, gen = jnp.arange(R, dtype=jnp.uint32), jnp.full(R, 5, jnp.int32)

    def draw(dist, s, j):  # Gumbel-max with the plain key fold_in(key(seed), gen + j)
        key = jax.random.fold_in(jax.random.key(s), 5 + j)
        return jnp.argmax(jnp.log(dist) + jax.random.gumbel(key, (V,)))

    @jax.jit
    def run():
        rows = jnp.arange(K1)
        drafts = jax.vmap(lambda s: jax.vmap(lambda d, j: draw(d, s, j))(jnp.asarray(q), rows[:-1]))(seed)
        target = jax.vmap(lambda s: jax.vmap(lambda d, j: draw(d, s, j))(jnp.asarray(p), rows))(seed)
        if greedy:
            target = jnp.broadcast_to(jnp.argmax(jnp.asarray(p), -1), (R, K1))
        tok = rejection_sample(jnp.broadcast_to(jnp.asarray(p), (R, K1, V)),
                               jnp.broadcast_to(jnp.asarray(q), (R,) + q.shape),
                               drafts.astype(jnp.int32), jnp.full(R, K1 - 1, jnp.int32), target.astype(jnp.int32),
                               seed, gen, jnp.full(R, greedy))
        return tok, drafts
    return tuple(np.asarray(a) for a in run())


def _position_stats(tokens, p):
    """Chi-square statistics of position 0 against p[0] and of position 1 (rows that accepted d_0) against p[1]."""
    out = []
    for j in range(2):
        rows = tokens[:, j] >= 0                                      # position 1: d_0 was accepted
        assert rows.sum() > 1000
        out.append(_chi2(np.bincount(tokens[rows, j], minlength=p.shape[1]), p[j]))
    return out


def test_rejection_sampling_keeps_the_target_distribution():
    tokens, _ = _draws(P, Q, 8000)
    for stat, df in _position_stats(tokens, P):
        assert stat < CRITICAL[df]
    assert ((tokens >= 0).sum(1) >= 1).all() and ((tokens >= 0).sum(1) == 3).any()  # partial and full runs


@pytest.mark.parametrize("rule", [lambda p_d, q_d, u: jnp.ones_like(u, bool), lambda p_d, q_d, u: u < p_d],
                         ids=["always-accept", "accept-with-p"])
def test_wrong_acceptance_rules_fail(monkeypatch, rule):
    monkeypatch.setattr(rejection, "accept_rule", rule)
    tokens, _ = _draws(P, Q, 8000)
    stat, df = _position_stats(tokens, P)[0]
    assert stat > CRITICAL[df]


def test_proposals_from_the_target_itself_are_all_accepted_and_greedy_takes_the_argmax_prefix():
    tokens, drafts = _draws(P, P[:2], 500)
    assert (tokens[:, :2] == drafts).all() and (tokens[:, 2] >= 0).all()
    tokens, drafts = _draws(P, Q, 300, greedy=True)
    best = P.argmax(-1)                                                # [0, 2, 0]
    for t, d in zip(tokens, drafts):
        a = int(d[0] == best[0]) * (1 + int(d[1] == best[1]))
        assert t.tolist() == list(d[:a]) + [best[a]] + [-1] * (2 - a)


# -- the engine with a draft model ----------------------------------------------------------------------
V = 320
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """target; unrelated (another random model); flat (the target with its head halved: the same
    ranking, a flatter q); other_vocab."""
    from safetensors.numpy import load_file, save_file

    from jaxpaged.testing.tiny_models import make_tiny_model
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(str(root / "target"), "llama", vocab_size=V)
    flat = str(root / "flat")
    shutil.copytree(target, flat)
    f = os.path.join(flat, "model.safetensors")
    w = load_file(f)
    save_file({k: v * 0.5 if k == "lm_head.weight" else v for k, v in w.items()}, f, metadata={"format": "pt"})
    return dict(target=target, flat=flat,
                unrelated=make_tiny_model(str(root / "unrelated"), "llama", vocab_size=V, seed=7),  # shapes shared:
                # its compiled draft steps are the target-as-draft's (the session's compilation cache)
                other_vocab=make_tiny_model(str(root / "other"), "llama", vocab_size=256, seed=3, hidden_size=32,
                                            num_layers=1))


def _prompts():
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, 300, size=36)]
    prompts = [[int(t) for t in rng.integers(3, 300, size=n)] for n in (1, 6, 17, 40)]
    prompts += [shared + [int(t) for t in rng.integers(3, 300, size=n)] for n in (3, 12)] + [shared]
    return [{"prompt_token_ids": p} for p in prompts]


def _draft_llm(models, engine_kwargs, draft, k=3, **over):
    """An engine with a draft; a 16-token budget (chunked prefill; two step buckets to compile, shared by
    the tests through the session's compilation cache)."""
    over = {"max_num_batched_tokens": 16, **over}
    llm = LLM(model=models["target"], **{**engine_kwargs, **over, "speculative_config": {
        "method": "draft_model", "model": models[draft], "num_speculative_tokens": k}})
    llm.engine.spec.governor = AlwaysPropose()
    return llm


def _tokens(llm, params, prompts=None):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts or _prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(models, engine_kwargs):
    llm = LLM(model=models["target"], **engine_kwargs)
    return llm, _tokens(llm, GREEDY), _tokens(llm, SAMPLED)


def _spec_stats(llm):
    return {k[len("spec_decode_"):]: v for k, v in llm.engine.stats().items() if k.startswith("spec_decode_num")}


def test_target_as_its_own_draft(models, engine_kwargs, plain):
    """Every proposal accepted, greedy and seeded sampling equal to the plain run (the draft draws with the
    plain run's keys), through preemption, chunked prefill and prefix hits (the draft's pool holds the
    cached blocks too); the metrics count the proposals."""
    from serve.metrics import _EngineCollector
    llm = _draft_llm(models, engine_kwargs, "target", num_kv_blocks=8)
    assert _tokens(llm, GREEDY) == plain[1]
    st = _spec_stats(llm)
    assert st["num_drafts"] > 0 and st["num_accepted_tokens"] == st["num_draft_tokens"] >= st["num_drafts"]
    assert min(st["num_accepted_tokens_per_pos"]) > 0
    full = llm.engine.stats()
    assert full["num_preemptions"] > 0 and full["prefix_cache_hit_rate"] > 0
    assert _tokens(llm, SAMPLED) == plain[2]
    got = {m.name: m.samples for m in _EngineCollector(llm.engine, "tiny", 1024).collect()}
    st = _spec_stats(llm)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert got[f"jaxpaged:spec_decode_{name}"][0].value == st[name] > 0
    per_pos = got["jaxpaged:spec_decode_num_accepted_tokens_per_pos"]
    assert [x.value for x in per_pos] == st["num_accepted_tokens_per_pos"]
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
    # mid-run, the draft's pool holds the target's K/V over every computed token (rollbacks included)
    eng.add_request("pool", _prompts()[2], SamplingParams(**{**SAMPLED.__dict__, "max_tokens": 40}))
    req = eng.groups["pool"].samples[0]
    while req.num_output_tokens < 30:
        eng.step()
    draft, n = eng.spec.proposer, req.num_computed_tokens
    assert n >= len(req.prompt_token_ids) + 29
    np.testing.assert_allclose(_kv(eng, req, n, draft.k_pool, draft.v_pool),
                               _kv(eng, req, n, eng.runner.k_pool, eng.runner.v_pool), rtol=1e-5, atol=1e-4)
    eng.abort_request("pool")


def _kv(eng, req, n, k_pool, v_pool):
    """f32[2, L, n, Hkv, hd]: K and V of the request's first n positions in a pool of the target's shape."""
    N, bs, L = eng.num_blocks, eng.config.block_size, eng.model_config.num_layers
    pos = np.arange(n)
    rows = (np.arange(L)[:, None] * N + np.asarray(req.block_ids)[pos // bs][None, :], pos[None, :] % bs)
    return np.stack([np.asarray(k_pool)[rows], np.asarray(v_pool)[rows]])


def test_unrelated_draft(models, engine_kwargs, plain):
    """Almost every proposal rejected: greedy still equals plain; seeded requests sample the same tokens
    again, alone and in a batch. (Not bitwise the same alone as in a batch: the verifier computes as many
    rows as the token bucket holds, and the residual max(0, p - q) of rejection sampling turns the last-bit
    differences of another row count into other draws; batch invariance is refused with speculation.)"""
    llm = _draft_llm(models, engine_kwargs, "unrelated", enable_prefix_caching=False)
    assert _tokens(llm, GREEDY) == plain[1]
    st = _spec_stats(llm)
    assert st["num_draft_tokens"] > 50 and st["num_accepted_tokens"] <= 0.05 * st["num_draft_tokens"]
    assert _tokens(llm, SAMPLED) == _tokens(llm, SAMPLED)
    alone = [_tokens(llm, SAMPLED, [p])[0] for p in _prompts()[2:4]]
    assert [_tokens(llm, SAMPLED, [p])[0] for p in _prompts()[2:4]] == alone


def _wilson_hilferty(df, z=3.09):
    """The chi-square distribution's quantile at normal deviate z (3.09: the 99.9th percentile)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def test_sampling_with_a_draft_keeps_the_distribution(models, engine_kwargs, plain):
    """Positions 1..3 (proposed, verified, bonus) of 600 seeded requests with a draft whose q differs from p
    follow the plain run's distribution (two-sample chi-square over independent seeds)."""
    prompt = {"prompt_token_ids": [5, 17, 99, 4]}
    N = 600

    def run(llm, first_seed):
        ps = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=first_seed + i, ignore_eos=True)
              for i in range(N)]
        return np.array([o.outputs[0].token_ids for o in llm.generate([prompt] * N, ps, use_tqdm=False)])
    base = run(plain[0], 0)
    llm = _draft_llm(models, engine_kwargs, "flat")
    spec = run(llm, N)
    st = _spec_stats(llm)
    assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]          # acceptances and rejections
    for j in (1, 2, 3):
        a, b = np.bincount(base[:, j], minlength=V), np.bincount(spec[:, j], minlength=V)
        big = (a + b) >= 10                                                # small cells pooled
        a, b = np.append(a[big], a[~big].sum()), np.append(b[big], b[~big].sum())
        keep = (a + b) > 0
        stat = (((a - b) ** 2)[keep] / (a + b)[keep]).sum()
        assert stat < _wilson_hilferty(keep.sum() - 1), j


def test_draft_configs(models, engine_kwargs):
    """The JSON form (--speculative-config) parses; a bad draft is a ValueError naming the field, before
    the target loads."""
    cfg = EngineConfig(model=models["target"], speculative_config='{"method": "draft_model", "model": "%s", '
                       '"num_speculative_tokens": 2}' % models["unrelated"]).speculative_config
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", models["unrelated"], 2)
    from types import SimpleNamespace

    from jaxpaged.spec_decode.config import check_draft_engine
    for over, name in [(dict(num_processes=2), "num_processes"),
                       (dict(logprobs_mode="processed_logprobs"), "logprobs_mode")]:
        with pytest.raises(ValueError, match=f"draft_model.*{name}"):  # kept when n-gram composes with them
            check_draft_engine(SimpleNamespace(**{"tensor_parallel_size": 1, "data_parallel_size": 1,
                                                  "num_processes": 1, "logprobs_mode": "raw_logprobs", **over}))
    for cfg, msg in [({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
                     ({"method": "draft_model", "model": models["target"], "num_speculative_tokens": 2,
                       "prompt_lookup_min": 2}, "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model=models["target"], speculative_config=cfg)
    for draft in (models["other_vocab"], "/nonexistent"):
        with pytest.raises(ValueError, match="speculative_config.model"):
            LLM(model=models["target"], **engine_kwargs,
                speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
