"""Issue 13's families against HF transformers: Mistral with its window, Gemma 2/3, Phi-3, Mixtral,
Qwen3-MoE, OLMoE. Tiny random float32 models; windows of 8 tokens over blocks of 4."""
import dataclasses
import json

import numpy as np
import pytest
from oracle import hf_greedy, hf_last_logits
from test_oracle import _forward_last_logits, _prompts

from jaxpaged import LLM, ModelConfig, SamplingParams
from jaxpaged.checkpoints.weights import param_shapes
from jaxpaged.step.mesh import param_partition_specs
from jaxpaged.testing.tiny_models import NEW_FAMILIES, WINDOW, make_tiny_model

BS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_model(str(root / f), f, seed=10 + i) for i, f in enumerate(NEW_FAMILIES)}


def _engine(path, engine_kwargs, **over):
    return LLM(model=path, **{**engine_kwargs, "block_size": BS, "max_num_batched_tokens": 16, **over})


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_logits_match_hf(family_models, family):
    path = family_models[family]
    prompts = _prompts(1, lens=(1, 7, 9, 17, 33, 70))
    got = _forward_last_logits(path, prompts, block_size=BS)
    for i, p in enumerate(prompts):
        want = hf_last_logits(path, p)
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_window_and_softcap_matter(family_models):
    """Dropping the window, or Gemma 2's soft-capping, changes the logits of long prompts: the tests
    above would catch a model that ignored them."""
    import jaxpaged.models.llama as llama
    prompts = _prompts(1, lens=(70,))
    for family, change in [("mistral_sw", dict(sliding_window=None, layer_types=())),
                           ("gemma2", dict(attn_softcap=None)), ("gemma2", dict(final_softcap=None))]:
        path = family_models[family]
        want = [hf_last_logits(path, p) for p in prompts]
        orig = ModelConfig.from_dir
        try:
            ModelConfig.from_dir = classmethod(lambda cls, d: dataclasses.replace(orig(d), **change))
            got = _forward_last_logits(path, prompts, block_size=BS)
        finally:
            ModelConfig.from_dir = orig
        assert max(np.abs(g - w).max() / np.abs(w).max() for g, w in zip(got, want)) > 1e-2, (family, change)
        assert llama  # the pure function is the one under test


@pytest.mark.parametrize("family", ["mistral_sw", "gemma2", "gemma3", "mixtral"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("phi3", "qwen3_moe", "olmoe")])
def test_greedy_through_engine(family_models, engine_kwargs, family):
    """Chunked prefill (16-token budget), prompts longer than the window, then the same prompts again
    (prefix-cache hits): tokens equal HF's greedy ones."""
    path = family_models[family]
    prompts = _prompts(3, lens=(5, 23, 41))
    llm = _engine(path, engine_kwargs)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) >= 40
    for p, a, b in zip(prompts, first, again):
        want = hf_greedy(path, p, GREEDY.max_tokens)
        assert a.outputs[0].token_ids == want and b.outputs[0].token_ids == want, f"{len(p)} tokens"


def test_window_blocks_freed_mistral(family_models, engine_kwargs):
    """Every Mistral layer slides: a request keeps only the blocks its window still reaches. A pool of
    12 blocks runs 4 requests of up to 94 tokens (24 blocks without freeing) with outputs equal to HF's,
    and preemption (a pool too small for all at once) still gives the same tokens."""
    path = family_models["mistral_sw"]
    prompts = _prompts(5, lens=(51, 70, 9, 60))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [hf_greedy(path, p, 24) for p in prompts]
    llm = _engine(path, engine_kwargs, num_kv_blocks=12, max_num_seqs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["num_preemptions"] == 0
    llm = _engine(path, engine_kwargs, num_kv_blocks=14, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    # n = 2: the second sample shares the first's prompt blocks only up to the first one dropped
    n2 = SamplingParams(n=2, max_tokens=24, temperature=0, ignore_eos=True)
    two = llm.generate([{"prompt_token_ids": prompts[1]}], n2, use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [want[1]] * 2
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_mixed_layers_keep_their_blocks(family_models, engine_kwargs):
    """Gemma mixes sliding and full layers: nothing may be freed (the full layers need every block)."""
    llm = _engine(family_models["gemma3"], engine_kwargs, warmup=False)
    assert llm.engine.block_manager.sliding_window is None
    assert _engine(family_models["mistral_sw"], engine_kwargs, warmup=False
                   ).engine.block_manager.sliding_window == WINDOW


def test_config_fields(family_models):
    g3 = ModelConfig.from_dir(family_models["gemma3"])
    assert g3.layer_period == 3 and g3.layer_window(2) is None and g3.layer_window(3) == WINDOW
    assert g3.rope_local_theta == 100.0 and g3.rope_scaling == ("linear", 4.0) and g3.qk_norm == "head"
    assert g3.query_scale == pytest.approx(24 ** -0.5) and g3.final_softcap == 8.0 and g3.norm_plus_one
    g2 = ModelConfig.from_dir(family_models["gemma2"])
    assert g2.layer_period == 2 and g2.attn_softcap == 3.0 and g2.hidden_act == "gelu_pytorch_tanh"
    mx = ModelConfig.from_dir(family_models["mixtral"])
    assert (mx.num_experts, mx.num_experts_per_tok, mx.norm_topk_prob) == (4, 2, True)
    assert ModelConfig.from_dir(family_models["olmoe"]).qk_norm == "flat"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gemma3", "phi3"])
def test_partition_specs_cover_params(family_models, family):
    """Every parameter has a spec of its rank; experts split over the axis (expert parallelism)."""
    cfg = ModelConfig.from_dir(family_models[family])
    shapes, specs = param_shapes(cfg), param_partition_specs(cfg, 2)
    assert set(specs) == set(shapes) and set(specs["layers"]) == set(shapes["layers"])
    for k, s in specs["layers"].items():
        assert len(s) in (0, len(shapes["layers"][k])), k
    if cfg.num_experts:
        assert tuple(specs["layers"]["w_down"]) == (None, "model", None, None)


def _edit(path, tmp_path, **change):
    d = json.load(open(f"{path}/config.json"))
    d.update(change)
    return ModelConfig.from_hf_dict(d, source="x/config.json")


def test_unsupported_variants_name_the_field(family_models, tmp_path):
    cases = [("gemma2", dict(hidden_activation="relu"), "hidden_activation"),
             ("phi3", dict(hidden_act="gelu"), "hidden_act"),
             ("phi3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling type 'dynamic'"),
             ("phi3", dict(partial_rotary_factor=0.5, rope_parameters=None), "partial_rotary_factor"),
             ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
             ("gemma2", dict(layer_types=["sliding_attention"]), "layer_types"),
             ("gemma2", dict(attn_logit_softcapping=-1), "attn_logit_softcapping"),
             ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
             ("mixtral", dict(num_experts_per_tok=9), "num_experts_per_tok"),
             ("olmoe", dict(clip_qkv=8.0), "clip_qkv")]
    for family, change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _edit(family_models[family], tmp_path, **change)


def test_phi3_longrope_short_factors(tmp_path):
    """longrope: the short factors and the attention factor, exact up to original_max_position_embeddings,
    to which the engine's length is capped (HF recomputes all keys with the long factors beyond it)."""
    rng = np.random.default_rng(0)
    scaling = {"rope_type": "longrope", "short_factor": [float(x) for x in 1 + rng.random(8)],
               "long_factor": [float(x) for x in 2 + rng.random(8)], "original_max_position_embeddings": 128}
    path = make_tiny_model(str(tmp_path / "phi"), "phi3", max_position_embeddings=1024,
                           rope_parameters={**scaling, "rope_theta": 10000.0},
                           original_max_position_embeddings=128)
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope_scaling[0] == "longrope" and cfg.max_position_embeddings == 128
    assert cfg.rope_scaling[2] == pytest.approx(np.sqrt(1 + np.log(8) / np.log(128)))
    prompts = _prompts(4, lens=(9, 70, 127))
    got = _forward_last_logits(path, prompts, block_size=BS)
    for i, p in enumerate(prompts):
        want = hf_last_logits(path, p)
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow
def test_pallas_backend_with_window_and_softcap(family_models, engine_kwargs):
    """The engine on the Pallas kernels (interpret mode on CPU), Gemma 2 (window + soft-capping + scale)
    and Mistral (window, blocks freed): the reference backend's tokens."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, lens=(3, 20, 37))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for family in ("gemma2", "mistral_sw"):
        kw = dict(max_num_seqs=4, max_num_batched_tokens=16)
        want = [o.outputs[0].token_ids for o in _engine(family_models[family], engine_kwargs, **kw).generate(
            prompts, params, use_tqdm=False)]
        llm = _engine(family_models[family], engine_kwargs, **kw, attention_backend="pallas")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


@pytest.mark.parametrize("family", ["phi3", "mixtral", "gemma3"])
def test_convert_keeps_params(family_models, tmp_path, family):
    """`jaxpaged convert` of the new families (fused Phi-3 tensors split, experts stacked, Gemma's extra
    norms): the orbax directory restores to the very arrays the HF directory loads to."""
    import jax

    from jaxpaged.checkpoints.convert import convert
    from jaxpaged.checkpoints.weights import load_params
    src = family_models[family]
    dst = convert(src, str(tmp_path / "dst"), dtype="float32", progress=False)
    cfg = ModelConfig.from_dir(dst)
    assert cfg == ModelConfig.from_dir(src)
    a, b = load_params(src, cfg, "float32"), load_params(dst, cfg, "float32")
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
