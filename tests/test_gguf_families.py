"""Every family from a GGUF file: tiny models written as llama.cpp writes them (gguf-py's GGUFWriter, its
quantizers), run by the engine straight from the .gguf in float32 activations, greedy tokens equal to HF
transformers' on the same weights (safetensors written from gguf.quants.dequantize)."""
import json
import os

import numpy as np
import pytest
from oracle import hf_greedy
from safetensors.numpy import save_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.testing.gguf_files import write_gguf
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model

VOCAB = 300
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# (tiny family, GGUF type): one model per family, the types gguf-py quantizes spread over them
CASES = [("mistral_sw", "Q8_0"), ("mixtral", "Q4_0"), ("gemma3", "Q4_1"), ("qwen3_moe", "Q5_0"),
         ("olmoe", "Q4_1")]


def _llama_cpp_gemma3(path):
    """Gemma 3 as llama.cpp runs it: layers slide but every 6th, local RoPE base 10000, queries scaled by
    head_dim ** -0.5, no soft-cap (the tiny model's config changed to that; its weights do not depend on it)."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.pop("layer_types")
    c.update(sliding_window_pattern=6, query_pre_attn_scalar=c["head_dim"], final_logit_softcapping=None,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """family -> (the .gguf, the HF reference directory holding the weights the file holds)."""
    out = {}
    for i, (family, qtype) in enumerate(CASES):
        root = tmp_path_factory.mktemp(family)
        hf = make_tiny_model(str(root / "hf"), family, vocab_size=VOCAB, seed=20 + i)
        add_tiny_tokenizer(hf, VOCAB)
        if family == "gemma3":
            _llama_cpp_gemma3(hf)
        values = {}
        path = write_gguf(hf, str(root / f"{family}.{qtype}.gguf"), qtype, values=values)
        save_file(values, os.path.join(hf, "model.safetensors"))  # the reference: what the file holds
        out[family] = path, hf
    return out


def _greedy(path, engine_kwargs, prompts, **over):
    """On XLA's product, the exact reference (the quantized CPU kernel, which runs kept codes on one CPU by
    default, rounds activations to int8: tests/test_gguf_write.py checks it within that rounding)."""
    llm = LLM(model=path, **{**engine_kwargs, "block_size": 4, "max_num_batched_tokens": 16, "matmul_backend": "xla",
                             **over})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (5, 14)]


@pytest.mark.parametrize("family,qtype", CASES)
def test_greedy_from_packed_gguf_equals_hf(gguf_models, engine_kwargs, family, qtype):
    """keep_quantized (the default): the matrices run as QArrays made from the file's codes."""
    path, ref = gguf_models[family]
    prompts = _prompts()
    assert _greedy(path, engine_kwargs, prompts) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]


def test_packed_and_dequantized_load(gguf_models):
    """The pytree: kept quantized, the matrices are QArrays of the file's form (Q4_1: 4-bit codes, groups of
    32, a minimum) standing for the dequantized matrices exactly; --no-keep-quantized, plain arrays."""
    from jaxpaged import ModelConfig
    from jaxpaged.checkpoints.gguf_load import gguf_model_dir, gguf_source, load_gguf_params
    from jaxpaged.models.qarray import QArray, dequantize
    path, _ = gguf_models["olmoe"]
    d = gguf_model_dir(path)
    assert gguf_source(d) == os.path.abspath(path) and gguf_model_dir(path) == d
    cfg = ModelConfig.from_dir(d)
    packed = load_gguf_params(path, cfg, "float32")
    plain = load_gguf_params(path, cfg, "float32", keep_quantized=False)
    for key in ("wq", "w_down", "w_gate"):
        a = packed["layers"][key]
        assert isinstance(a, QArray) and (a.bits, a.group, a.m is not None) == (4, 32, True), key
        np.testing.assert_array_equal(np.asarray(dequantize(a)), plain["layers"][key], err_msg=key)
    assert isinstance(packed["embed"], QArray) and not isinstance(plain["embed"], QArray)
    np.testing.assert_array_equal(np.asarray(dequantize(packed["embed"])), plain["embed"])
    assert not isinstance(packed["layers"]["router"], QArray) and not isinstance(packed["final_norm"], QArray)


def test_keep_quantized_flag_reaches_the_loader(gguf_models):
    """The engine's loading of a .gguf: keep_quantized (the default) keeps the file's codes; False (and
    quantization, which re-quantizes the dequantized weights) does not."""
    from jaxpaged import EngineConfig, ModelConfig, loading
    from jaxpaged.models.qarray import DEFAULT_GROUP, QArray
    path, _ = gguf_models["mixtral"]
    cfg = EngineConfig(model=path, dtype="float32", show_progress=False)
    d = loading.model_dir(cfg)
    mc = ModelConfig.from_dir(d)
    assert mc.family == "mixtral" and mc.num_experts == 4
    kept = loading.load_weights(d, mc, cfg)[0]["layers"]["w_up"]
    assert isinstance(kept, QArray) and (kept.bits, kept.group, kept.zero) == (4, 32, 8)
    cfg = EngineConfig(model=path, dtype="float32", show_progress=False, keep_quantized=False)
    assert not isinstance(loading.load_weights(d, mc, cfg)[0]["layers"]["w_up"], QArray)
    cfg = EngineConfig(model=path, dtype="float32", show_progress=False, quantization="int8")
    requantized = loading.load_weights(d, mc, cfg)[0]["layers"]["w_up"]
    assert isinstance(requantized, QArray) and (requantized.bits, requantized.group) == (8, DEFAULT_GROUP["int8"])
