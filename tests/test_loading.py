"""Loading Hugging Face directories directly: sharded, half precision on disk, any engine dtype."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, ModelConfig, SamplingParams
from jaxpaged.checkpoints.weights import load_params
from jaxpaged.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("f32")), "qwen2", seed=7)


@pytest.mark.parametrize("disk_dtype", ["bfloat16", "float16"])
def test_half_precision_on_disk_sharded(tmp_path, f32_dir, disk_dtype):
    path = make_tiny_model(str(tmp_path / disk_dtype), "qwen2", seed=7, dtype=disk_dtype, max_shard_size="20KB")
    import os
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    cfg = ModelConfig.from_dir(path)
    ref = load_params(f32_dir, cfg, "float32")
    for want_dtype in ("float32", "bfloat16"):
        got = load_params(path, cfg, want_dtype)
        assert got["layers"]["wq"].dtype == jnp.dtype(want_dtype)
        a = np.asarray(got["layers"]["wq"], np.float32)
        np.testing.assert_allclose(a, ref["layers"]["wq"], rtol=1e-2, atol=1e-2)


def test_bfloat16_engine_runs_and_mostly_agrees(f32_dir, engine_kwargs):
    prompts = [{"prompt_token_ids": [5, 9, 13, 200, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    f32 = LLM(model=f32_dir, **engine_kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=f32_dir, **{**engine_kwargs, "dtype": "bfloat16"})
    assert llm.engine.runner.k_pool.dtype == jnp.bfloat16
    bf16 = llm.generate(prompts, params, use_tqdm=False)
    # the first greedy token of peaked tiny models survives bf16 rounding
    assert [o.outputs[0].token_ids[0] for o in bf16] == [o.outputs[0].token_ids[0] for o in f32]


def test_no_tokenizer_means_token_ids_only(f32_dir, engine_kwargs):
    llm = LLM(model=f32_dir, **engine_kwargs)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].text == "" and len(out[0].outputs[0].token_ids) == 3


def test_missing_tensor_named(tmp_path, f32_dir):
    import shutil

    from safetensors.numpy import load_file, save_file
    d = tmp_path / "m"
    shutil.copytree(f32_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        load_params(str(d), ModelConfig.from_dir(str(d)), "float32")


def test_bfloat16_cpu_step_reads_weights_and_pool_as_stored(f32_dir, engine_kwargs):
    """On CPU the compiled bfloat16 step neither widens the stacked layer weights nor the KV pool to
    float32 (XLA's bf16 float normalization is off for it: runner.step_compiler_options)."""
    llm = LLM(model=f32_dir, **{**engine_kwargs, "dtype": "bfloat16"})
    r, mc = llm.engine.runner, llm.engine.model_config
    assert r.compiler_options == {"xla_disable_hlo_passes": "float-normalization-bf16"}
    text = r.compiled_step((r.buckets[0], False)).as_text()
    L, D, F = mc.num_layers, mc.hidden_size, mc.intermediate_size
    for shape in (f"f32[{L},{D},{F}]", f"f32[{L},{F},{D}]", "f32[" + ",".join(map(str, r.k_pool.shape)) + "]"):
        assert shape not in text, shape
    out = llm.generate([[5, 9, 13]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
