"""Prompts given as embeddings (issue #36): the model's own embedding rows as prompt_embeds give the token-id
prompt's greedy tokens, alone, beside token prompts in the same steps, over chunked prefill; never through
the prefix cache; refusals naming prompt_embeds."""
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Request
from jaxpaged.testing.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("embeds") / "m"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(path, engine_kwargs):
    # budget 64: a prompt of 100 positions is prefilled in chunks (64, then 36: not at a block boundary)
    return LLM(model=path, **engine_kwargs, enable_prompt_embeds=True)


def _ids(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


def _rows(llm, ids):
    """The embedding rows the token lookup gives for `ids`, float32 [len, D]."""
    return np.asarray(llm.get_weights()["embed"], np.float32)[ids]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("n", [1, 20, 100])
def test_embeds_give_the_token_prompts_tokens(llm, n):
    ids = _ids(n, n)
    want = _tokens(llm.generate([ids], GREEDY, use_tqdm=False))
    got = llm.generate({"prompt_embeds": _rows(llm, ids)}, GREEDY, use_tqdm=False)
    assert _tokens(got) == want
    assert got[0].outputs[0].finish_reason == "length" and len(got[0].prompt_token_ids) == n
    if n == 20:  # the embeddings are what the step reads, not the placeholder ids
        assert _tokens(llm.generate([[0] * n], GREEDY, use_tqdm=False)) != want


def test_mixed_batch(llm):
    """Embeddings and token prompts scheduled in the same steps (and one long one chunked beside them):
    each request gets its own tokens."""
    prompts = [_ids(10 + i, n) for i, n in enumerate((12, 70, 5, 33))]
    want = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    mixed = [{"prompt_embeds": _rows(llm, p)} if i % 2 == 0 else p for i, p in enumerate(prompts)]
    assert _tokens(llm.generate(mixed, GREEDY, use_tqdm=False)) == want
    # samples of one embeddings prompt share its blocks directly and each draws its own tokens
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2)
    a = llm.generate({"prompt_embeds": _rows(llm, prompts[0])}, sampled, use_tqdm=False)[0]
    b = llm.generate([prompts[0]], sampled, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_jax_bfloat16_and_three_axes(llm):
    """A jax array (bfloat16 here: its values are exact in float32) and a leading axis of 1 are taken."""
    import jax.numpy as jnp
    ids = _ids(7, 9)
    rows = jnp.asarray(_rows(llm, ids)).astype(jnp.bfloat16)
    want = _tokens(llm.generate({"prompt_embeds": np.asarray(rows.astype(jnp.float32))}, GREEDY, use_tqdm=False))
    assert _tokens(llm.generate({"prompt_embeds": rows[None]}, GREEDY, use_tqdm=False)) == want


def test_never_through_the_prefix_cache(llm):
    ids = _ids(99, 48)  # three full blocks of 16
    llm.generate([ids], GREEDY, use_tqdm=False)  # its blocks are cached now
    bm = llm.engine.block_manager
    cached, hits, queried = dict(bm.cache), bm.hit_tokens, bm.queried_tokens
    want = _tokens(llm.generate([ids], GREEDY, use_tqdm=False))
    assert bm.hit_tokens > hits  # the token prompt hits
    cached, hits, queried = dict(bm.cache), bm.hit_tokens, bm.queried_tokens
    got = llm.generate({"prompt_embeds": _rows(llm, ids)}, GREEDY, use_tqdm=False)
    assert _tokens(got) == want
    assert (bm.cache, bm.hit_tokens, bm.queried_tokens) == (cached, hits, queried)  # neither used nor filled


def test_block_manager_keeps_embeddings_out():
    bm = BlockManager(16, 4)
    req = Request("r", "r", 0, [0] * 9, GREEDY, seed=0, prompt_embeds=np.zeros((9, 4), np.float32))
    twin = Request("t", "t", 0, [0] * 9, GREEDY, seed=0)
    for r in (req, twin):
        assert bm.match_prefix(r) == 0 and bm.allocate(r, 9)
        r.num_computed_tokens = 9
        bm.cache_blocks(r)
    assert not req.cacheable and twin.cacheable
    assert set(bm.cache.values()) == set(twin.block_ids[:2])  # only the token request's full blocks


def test_no_extra_compilation(llm):
    """With the flag, one compiled step per bucket, as without it (the inputs are there in every step)."""
    assert llm.stats()["num_compilations"] == len(llm.engine.runner.variants())


def test_refusals(llm):
    D, L = 64, 256
    good = np.zeros((4, D), np.float32)
    cases = [
        (np.zeros((4, D), np.int32), "not a floating-point type"),
        (np.zeros(D, np.float32), "2-D"),
        (np.zeros((2, 4, D), np.float32), "2-D"),
        (np.zeros((4, D + 1), np.float32), "hidden size 65 does not match the model's hidden_size 64"),
        (np.zeros((0, D), np.float32), "empty"),
        (np.zeros((L, D), np.float32), "max_model_len is 256"),
        (np.full((4, D), np.nan, np.float32), "non-finite"),
        ("abc", "not a floating-point type"),
    ]
    for value, words in cases:
        with pytest.raises(ValueError, match=words) as e:
            llm.generate({"prompt_embeds": value}, GREEDY, use_tqdm=False)
        assert e.value.param == "prompt_embeds" and "prompt_embeds" in str(e.value)
    with pytest.raises(ValueError, match="no other keys") as e:
        llm.generate({"prompt_embeds": good, "prompt_token_ids": [1, 2, 3, 4]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs") as e:
        llm.generate({"prompt_embeds": good}, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert e.value.param == "prompt_embeds"
    assert not llm.engine.has_unfinished_requests()


def test_off_by_default(path, engine_kwargs):
    """Without enable_prompt_embeds: refused by name, and the step has no input of the feature."""
    llm = LLM(model=path, **engine_kwargs)
    with pytest.raises(ValueError, match="enable_prompt_embeds") as e:
        llm.generate({"prompt_embeds": np.zeros((4, 64), np.float32)}, GREEDY, use_tqdm=False)
    assert e.value.param == "prompt_embeds"
    batch, sp = llm.engine.runner.dummy_inputs(8)
    assert "from_embeds" not in batch and "prompt_embeds" not in sp


def test_preemption_and_speculation_keep_outputs(llm, path, engine_kwargs):
    """A pool too small for the batch (preempted requests recompute their prompts from the embeddings) and
    n-gram proposals (over the placeholder ids too): greedy outputs stay those of the token prompts."""
    prompts = [_ids(40 + i, 30 + 7 * i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _tokens(llm.generate(prompts, params, use_tqdm=False))
    table = np.asarray(llm.get_weights()["embed"], np.float32)
    small = LLM(model=path, **{**engine_kwargs, "max_num_batched_tokens": 32}, enable_prompt_embeds=True,
                num_kv_blocks=14, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    mixed = [{"prompt_embeds": table[p]} if i % 2 else p for i, p in enumerate(prompts)]
    assert _tokens(small.generate(mixed, params, use_tqdm=False)) == want
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_async_scheduling_keeps_outputs(llm, path, engine_kwargs):
    """Async scheduling (step t+1 prepared while step t runs): embeddings of chunked prompts beside decodes."""
    prompts = [_ids(60 + i, n) for i, n in enumerate((90, 8, 41))]
    want = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    table = np.asarray(llm.get_weights()["embed"], np.float32)
    eng = LLM(model=path, **engine_kwargs, enable_prompt_embeds=True, async_scheduling=True)
    assert eng.engine.async_scheduling
    mixed = [{"prompt_embeds": table[p]} if i != 1 else p for i, p in enumerate(prompts)]
    assert _tokens(eng.generate(mixed, GREEDY, use_tqdm=False)) == want


def test_abstract_step_compiles_with_the_flag():
    """The step with the feature compiles for any mesh (step/aot.py): its placeholder is abstract too."""
    from jaxpaged.config import EngineConfig, ModelConfig
    from jaxpaged.step.aot import abstract_runner, compile_steps
    from jaxpaged.step.mesh import make_mesh
    from jaxpaged.step.prompt_embeds import PromptEmbeds
    mc = ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
                                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6))
    for on in (False, True):
        cfg = EngineConfig(dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                           compilation_cache_dir=None, attention_backend="reference", enable_prompt_embeds=on)
        runner = abstract_runner(mc, cfg, make_mesh(1), num_blocks=32)
        assert any(isinstance(f, PromptEmbeds) for f in runner.features) == on
        (tokens, *_), _ = compile_steps(runner, [(8, False)])[(8, False)].out_info[0]
        assert tokens.shape == (4,)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_embeds_as_vllm_reads_them(family, engine_kwargs, tmp_path):
    """Gemma 3 takes prompt_embeds as given (vLLM, and HF's `inputs_embeds`); vLLM's Gemma 2 scales them by
    sqrt(hidden) as it scales the lookup (HF's Gemma 2 takes `inputs_embeds` as given: it gets them scaled)."""
    import torch
    from transformers import AutoModelForCausalLM
    path = make_tiny_model(str(tmp_path / family), family, seed=5)
    embeds = np.random.default_rng(0).normal(0, 0.5, (2, 11, 64)).astype(np.float32)  # [prompts, len, D]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    given = torch.from_numpy(embeds) * (float(np.sqrt(64)) if family == "gemma2" else 1.0)
    with torch.no_grad():
        want = hf.generate(inputs_embeds=given, attention_mask=torch.ones(given.shape[:2], dtype=torch.long),
                           max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0).tolist()
    llm = LLM(model=path, **engine_kwargs, enable_prompt_embeds=True)
    got = _tokens(llm.generate([{"prompt_embeds": e} for e in embeds],
                               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False))
    assert got == want
