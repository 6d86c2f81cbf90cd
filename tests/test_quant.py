"""Weight-only quantization (jaxpaged/models/quant.py): the round trip, the products against float, every
family's step against float32 and against its own dequantized weights, loading and conversion."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, EngineConfig, SamplingParams
from jaxpaged.checkpoints.weights import load_params
from jaxpaged.config import ModelConfig
from jaxpaged.models.llama import forward
from jaxpaged.models.quant import QArray, dequantize, dot, quantize, quantize_params, ragged_dot, take_rows
from jaxpaged.step.attention import make_attention
from jaxpaged.testing.tiny_models import make_tiny_model

RNG = np.random.default_rng(0)


def _w(*shape):
    return (RNG.standard_normal(shape) * RNG.uniform(0.1, 3, shape[-1])).astype(np.float32)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_round_trip_error_bounded(fmt):
    w = _w(3, 40, 24)  # stacked [L, in, out]
    qa = quantize(w, fmt, -2)
    assert qa.q.dtype == (np.int8 if fmt == "int8" else jnp.float8_e4m3fn) and qa.q.shape == w.shape
    assert qa.scale.shape == (3, 1, 24) and qa.scale.dtype == np.float32
    err = np.abs(dequantize(qa) - w)
    if fmt == "int8":  # half a step of the column's scale
        assert np.all(err <= qa.scale / 2 * (1 + 1e-6))
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 in steps of 2^-9
        assert np.all(err <= np.maximum(np.abs(w) / 16, qa.scale * 2.0 ** -10) * (1 + 1e-6))
    assert np.abs(dequantize(qa)).max(axis=-2).round(4).tolist() == np.abs(w).max(axis=-2).round(4).tolist()
    emb = quantize(_w(50, 16), fmt, -1)  # the embedding: one scale per row
    assert emb.scale.shape == (50, 1)


def test_products_match_dequantized(monkeypatch):
    import jaxpaged.models.quant as quant
    monkeypatch.setattr(quant, "COLUMN_CHUNK", 16)  # wide matrices (>= 32 columns) go through the loop
    x = jnp.asarray(RNG.standard_normal((5, 40)), jnp.float32)
    w = _w(40, 24)
    qa = jax.tree.map(jnp.asarray, quantize(w, "int8", -2))
    want = x @ dequantize(qa)
    np.testing.assert_allclose(dot(x, qa), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dot(x, qa), x @ w, rtol=0, atol=0.02 * np.abs(x @ w).max())  # quantization error
    assert dot(x, jnp.asarray(w)).dtype == jnp.float32 and dot(x.astype(jnp.bfloat16), qa).dtype == jnp.bfloat16
    emb = jax.tree.map(jnp.asarray, quantize(_w(50, 40), "int8", -1))
    ids = jnp.array([3, 0, 49, 3])
    np.testing.assert_allclose(take_rows(emb, ids), dequantize(emb)[ids], rtol=1e-6)
    for n in (50, 64):  # the tied head: the embedding's transpose (64 rows: 4 chunks of 16)
        emb = jax.tree.map(jnp.asarray, quantize(_w(n, 40), "int8", -1))
        np.testing.assert_allclose(dot(x, emb, jnp.float32, transpose=True), x @ dequantize(emb).T,
                                   rtol=1e-5, atol=1e-5)
    wide = jax.tree.map(jnp.asarray, quantize(_w(40, 48), "fp8", -2))  # an untied lm_head, 3 chunks
    np.testing.assert_allclose(dot(x, wide, jnp.float32), x @ dequantize(wide), rtol=1e-5, atol=1e-5)
    experts = jax.tree.map(jnp.asarray, quantize(_w(3, 40, 24), "fp8", -2))
    sizes = jnp.array([2, 0, 3], jnp.int32)
    np.testing.assert_allclose(ragged_dot(x, experts, sizes, jnp.array([0, 0, 2, 2, 2])),
                               jax.lax.ragged_dot(x, dequantize(experts), sizes), rtol=1e-5, atol=1e-5)


def test_bad_quantization_names_the_argument(tmp_path):
    from jaxpaged.checkpoints.convert import convert
    for call in (lambda: EngineConfig(quantization="int3"), lambda: quantize(np.ones((2, 2)), "q4", -2),
                 lambda: convert(str(tmp_path), str(tmp_path / "o"), quantization="Q4_1")):
        with pytest.raises(ValueError, match="quantization must be None, 'int8', 'int4' or 'fp8'"):
            call()


def _all_position_logits(params, cfg, ids):
    """Logits f32[len(ids), V] of one prompt at every position (the pure step, reference attention)."""
    bs, T = 4, len(ids)
    nb = -(-T // bs)
    pool = jnp.zeros((cfg.num_layers * (nb + 1), bs, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    batch = dict(input_ids=jnp.array(ids, jnp.int32), positions=jnp.arange(T, dtype=jnp.int32),
                 slot_mapping=jnp.arange(T, dtype=jnp.int32) + bs, block_tables=jnp.arange(1, nb + 1)[None],
                 seq_lens=jnp.array([T], jnp.int32), query_start_loc=jnp.array([0, T], jnp.int32),
                 logits_indices=jnp.arange(T, dtype=jnp.int32))
    logits, _, _ = jax.jit(lambda p: forward(p, cfg, pool, pool, batch, make_attention("reference", False)))(params)
    return np.asarray(logits)


FAMILIES = [("llama", {}, ("int8",)), ("qwen3", dict(tie=True), ("fp8",)),
            pytest.param("mixtral", {}, ("int8", "fp8"), marks=pytest.mark.slow),
            pytest.param("gemma2", {}, ("int8",), marks=pytest.mark.slow),
            pytest.param("phi3", {}, ("int8",), marks=pytest.mark.slow)]
# teacher-forced top-1 agreement at least, mean |logit error| / mean |logit| at most (tiny random models)
BOUNDS = {"int8": (0.8, 0.08), "fp8": (0.7, 0.25)}


@pytest.mark.parametrize("family,kw,fmts", FAMILIES)
def test_family_step_against_float(tmp_path, family, kw, fmts):
    """int8 and fp8 weights: the step equals float32 on the dequantized weights (the products are right),
    and stays close to the original float32 (teacher-forced top-1 agreement, logits)."""
    path = make_tiny_model(str(tmp_path / family), family, seed=7, initializer_range=0.2, **kw)
    cfg = ModelConfig.from_dir(path)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 250, 24)]
    ref = _all_position_logits(jax.tree.map(jnp.asarray, load_params(path, cfg, "float32")), cfg, ids)
    for fmt in fmts:
        qp = load_params(path, cfg, "float32", quantization=fmt)
        assert isinstance(qp["layers"]["wq"], QArray) and isinstance(qp["embed"], QArray)
        got = _all_position_logits(jax.tree.map(jnp.asarray, qp), cfg, ids)
        deq = _all_position_logits(jax.tree.map(jnp.asarray, quantize_params(qp, None, "float32")), cfg, ids)
        np.testing.assert_allclose(got, deq, rtol=1e-4, atol=1e-4 * np.abs(deq).max())
        top1, rel = np.mean(got.argmax(-1) == ref.argmax(-1)), np.abs(got - ref).mean() / np.abs(ref).mean()
        assert top1 >= BOUNDS[fmt][0] and rel <= BOUNDS[fmt][1], (fmt, top1, rel)


def _dir_bytes(path):
    import os
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_to_int8(tmp_path, qtype):
    """A Q8_0 / Q4_1 GGUF converts straight to int8 (tensors widened one at a time): within half an int8
    step of the GGUF's own values, a third of the float32 checkpoint's bytes."""
    from test_convert import _hf_dir, write_gguf

    from jaxpaged.checkpoints.convert import convert
    gguf = write_gguf(_hf_dir(tmp_path / "hf"), str(tmp_path / "m.gguf"), qtype)
    f32 = convert(gguf, str(tmp_path / "f32"), dtype="float32", progress=False, keep_quantized=False)
    i8 = convert(gguf, str(tmp_path / "i8"), dtype="float32", progress=False, quantization="int8")
    cfg = ModelConfig.from_dir(i8)
    ref, got = load_params(f32, cfg, "float32"), load_params(i8, cfg, "float32", quantization="int8")
    for path, a in jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, QArray))[0]:
        want = ref[path[0].key] if len(path) == 1 else ref["layers"][path[1].key]
        if isinstance(a, QArray):
            assert a.q.dtype == np.int8
            n = a.q.shape[a.axis]  # each entry's scale (the embedding's in groups of quant.EMBED_GROUP)
            step = np.take(a.scale, np.arange(n) // (a.group or n), axis=a.axis)
            assert np.all(np.abs(dequantize(a) - want) <= step / 2 * (1 + 1e-5)), path
        else:
            np.testing.assert_array_equal(a, want)
    assert _dir_bytes(i8 + "/params") < 0.35 * _dir_bytes(f32 + "/params")


def test_convert_quantized_round_trip(tmp_path, engine_kwargs):
    """`jaxpaged convert --quantization int8` writes the quantized pytree; it loads back bit for bit as
    int8, widened to float (quantization=None) or re-quantized (fp8), and the engine's greedy tokens on
    the int8 weights equal those on the same weights widened to float32."""
    from test_convert import _hf_dir

    from jaxpaged.cli import main
    src = _hf_dir(tmp_path / "hf", initializer_range=0.2)
    dst = str(tmp_path / "i8")
    assert main(["convert", src, dst, "--quantization", "int8", "--dtype", "float32"]) == 0
    cfg = ModelConfig.from_dir(dst)
    direct = load_params(src, cfg, "float32", quantization="int8")
    back = load_params(dst, cfg, "float32", quantization="int8")
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    widened = load_params(dst, cfg, "float32")
    np.testing.assert_array_equal(widened["layers"]["w_up"], dequantize(back["layers"]["w_up"]))
    assert load_params(dst, cfg, "float32", quantization="fp8")["layers"]["wo"].format == "fp8"
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 40, 3, 99, 23][:n]} for n in (2, 6)]
    outs = [[o.outputs[0].token_ids for o in LLM(model=dst, quantization=q, **engine_kwargs)
             .generate(prompts, sp, use_tqdm=False)] for q in ("int8", None)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_step_hlo_widens_no_whole_matrix(tmp_path, engine_kwargs, monkeypatch, quantization):
    """The compiled step never holds a float copy of a whole stacked weight or of the embedding (int8:
    each layer's slice is widened inside the layer loop, the head chunk by chunk), and never copies the
    stacked weights into the loop (the scan reads them where they are)."""
    import re

    import jaxpaged.models.quant as quant
    monkeypatch.setattr(quant, "COLUMN_CHUNK", 64)  # the tiny vocabulary (256) takes the wide-head path
    path = make_tiny_model(str(tmp_path / "m"), "llama", tie=True, num_layers=3, seed=2)
    # XLA's products (the reference path; on one CPU the int8 matrices are otherwise packed for the
    # quantized kernel, tests/test_quant_int4.py)
    llm = LLM(model=path, quantization=quantization, matmul_backend="xla", **engine_kwargs)
    r = llm.engine.runner
    cfg = r.model_cfg
    # a bucket T unlike the matrices' sizes: the prompt-logprobs logits f32[T, V] must not pass for the head
    key = next(v for v in r.variants()[::-1] if v[0] not in (cfg.hidden_size, cfg.vocab_size))
    text = r.compiled_step(key).as_text()
    # the weights themselves (a QArray's codes; its scales and minima are float already)
    weights = jax.tree.map(lambda a: a.q if isinstance(a, QArray) else a, r.params,
                           is_leaf=lambda a: isinstance(a, QArray))
    stacked = {",".join(map(str, a.shape)) for a in jax.tree.leaves(weights) if a.ndim == 3 and a.shape[1] > 1}
    whole = stacked | {f"{cfg.vocab_size},{cfg.hidden_size}", f"{cfg.hidden_size},{cfg.vocab_size}"}
    floats = set(re.findall(r"f32\[([\d,]+)\]", text))
    assert not floats & (whole if quantization else {f"3,1,{s[2:]}" for s in stacked}), floats & whole
    copies = re.findall(r"= (\w+)\[([\d,]+)\]\{[\d,]*\} (?:copy|fusion)\([^)]*\), kind=kLoop, "
                        r"calls=%wrapped_copy", text)
    assert not [c for c in copies if c[1] in stacked or c[1].startswith("3,1,")], copies
    assert ("s8[" in text) == (quantization == "int8")
