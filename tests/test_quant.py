"""Weight-only quantization (jaxpaged/quant.py): the round trip, the products against float, every
family's step against float32 and against its own dequantized weights, loading and conversion."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, EngineConfig, SamplingParams
from jaxpaged.config import ModelConfig
from jaxpaged.models.llama import forward
from jaxpaged.attention import make_attention
from jaxpaged.quant import QArray, dequantize, dot, quantize, quantize_params, ragged_dot, take_rows
from jaxpaged.weights import load_params
from models import make_tiny_model

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


def test_products_match_dequantized():
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
    np.testing.assert_allclose(dot(x, emb.T, preferred_element_type=jnp.float32), x @ dequantize(emb).T,
                               rtol=1e-5, atol=1e-5)  # the tied head: the embedding's transpose
    experts = jax.tree.map(jnp.asarray, quantize(_w(3, 40, 24), "fp8", -2))
    sizes = jnp.array([2, 0, 3], jnp.int32)
    np.testing.assert_allclose(ragged_dot(x, experts, sizes, jnp.array([0, 0, 2, 2, 2])),
                               jax.lax.ragged_dot(x, dequantize(experts), sizes), rtol=1e-5, atol=1e-5)


def test_bad_quantization_names_the_argument(tmp_path):
    from jaxpaged.convert import convert
    for call in (lambda: EngineConfig(quantization="int4"), lambda: quantize(np.ones((2, 2)), "q4", -2),
                 lambda: convert(str(tmp_path), str(tmp_path / "o"), quantization="Q4_1")):
        with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'fp8'"):
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


FAMILIES = [("llama", {}, ("int8", "fp8")), ("qwen3", dict(tie=True), ("int8",)),
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
