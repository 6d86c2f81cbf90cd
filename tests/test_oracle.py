"""Numerics against HF transformers: logits of the pure model function and greedy tokens of the engine."""
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import hf_greedy, hf_last_logits

from jaxpaged import LLM, ModelConfig, SamplingParams
from jaxpaged.checkpoints.weights import load_params
from jaxpaged.models.llama import forward
from jaxpaged.step.attention import make_attention
from jaxpaged.testing.tiny_models import FAMILIES, make_tiny_model

PROMPT_LENS = (1, 7, 16, 17, 33, 70)


def _prompts(seed, vocab=256, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in lens]


def _forward_last_logits(path, prompts, block_size=16):
    """Run the pure model function once over several packed prompts; logits at each one's last token."""
    cfg = ModelConfig.from_dir(path)
    params = jnp_tree(load_params(path, cfg, "float32"))
    S, bs = len(prompts), block_size
    per_seq = max(-(-len(p) // bs) for p in prompts)
    N = 1 + S * per_seq
    pool = jnp.zeros((cfg.num_layers * N, bs, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    ids, pos, slots, qsl, tables = [], [], [], [0], np.zeros((S, per_seq), np.int32)
    for i, p in enumerate(prompts):
        blocks = [1 + i * per_seq + j for j in range(per_seq)][::-1]  # scattered, reversed order
        tables[i] = blocks
        for t, tok in enumerate(p):
            ids.append(tok)
            pos.append(t)
            slots.append(blocks[t // bs] * bs + t % bs)
        qsl.append(qsl[-1] + len(p))
    batch = dict(input_ids=jnp.array(ids, jnp.int32), positions=jnp.array(pos, jnp.int32),
                 slot_mapping=jnp.array(slots, jnp.int32), block_tables=jnp.array(tables),
                 seq_lens=jnp.array([len(p) for p in prompts], jnp.int32),
                 query_start_loc=jnp.array(qsl, jnp.int32), logits_indices=jnp.array(qsl[1:], jnp.int32) - 1)
    logits, _, _ = forward(params, cfg, pool, pool, batch, make_attention("reference", False))
    return np.asarray(logits)


def jnp_tree(t):
    import jax
    return jax.tree.map(jnp.asarray, t)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logits_match_hf(tiny_models, family):
    path = tiny_models[family]
    prompts = _prompts(1)
    got = _forward_last_logits(path, prompts)
    for i, p in enumerate(prompts):
        want = hf_last_logits(path, p)
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("variant", ["llama3_rope_tied", "gqa4_hd32"])
def test_forward_variants_match_hf(tmp_path, variant):
    if variant == "llama3_rope_tied":
        path = make_tiny_model(str(tmp_path / variant), "llama", tie=True, max_position_embeddings=512,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                             "rope_theta": 10000.0})
    else:
        path = make_tiny_model(str(tmp_path / variant), "qwen2", num_heads=8, num_kv_heads=2, head_dim=32)
    prompts = _prompts(2)
    got = _forward_last_logits(path, prompts)
    for i, p in enumerate(prompts):
        want = hf_last_logits(path, p)
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_hf(tiny_models, engine_kwargs, family):
    path = tiny_models[family]
    prompts = _prompts(3)
    llm = LLM(model=path, **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, 24), f"prompt of {len(p)} tokens"
        assert o.outputs[0].finish_reason == "length"
    # the first generated token's logprob equals HF's log_softmax
    outs = llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=1, temperature=0,
                                                                           logprobs=3), use_tqdm=False)
    want = hf_last_logits(path, prompts[3]).astype(np.float64)
    want = want - np.log(np.exp(want - want.max()).sum()) - want.max()
    lp = outs[0].outputs[0].logprobs[0]
    top = np.argsort(-want)[:3]
    assert set(lp) >= set(int(t) for t in top)
    for t, v in lp.items():
        assert abs(v - want[t]) < 1e-3
