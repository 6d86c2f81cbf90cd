"""int8 with a per-group minimum (`quantization_symmetric=False` under int8): codes 0..255 stored as signed bytes,
the minimum folded for the kernel's layout (jaxpaged/models/qarray.py `folded_minimum`, qpacked.py `_folded`)."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_quant_int4 import _check_against_float, q4_1_values

from jaxpaged import LLM, EngineConfig
from jaxpaged.models import qpacked
from jaxpaged.models.qarray import dequantize, folded_minimum, group_of, quantize, restored, symmetric_of
from jaxpaged.testing.kernel_activations import int8_rounded
from jaxpaged.testing.tiny_models import make_tiny_model
from pallas_kernels.matmul import cpu_quant

KERNEL = cpu_quant.available()


@pytest.mark.parametrize("shape,axis", [((64, 16), -2), ((100, 24), -2), ((3, 33, 40), -2), ((50, 96), -1)])
def test_minimum_holds_q4_1_values_and_bounds_the_error(shape, axis):
    """Q4_1 values (a 4-bit checkpoint, as the default model's layers) come back to float16 rounding of
    their step (17 int8 steps make one Q4_1 step), where symmetric int8 misses them by up to half its
    step; any data comes back within half a step of its group, codes 0..255, float16 scales."""
    rng = np.random.default_rng(sum(shape))
    w, _, _ = q4_1_values(rng, shape, axis)
    qa = quantize(w, "int8", axis, group=32, symmetric=False)
    assert qa.zero == 128 and qa.bits == 8 and qa.m.shape == qa.scale.shape
    assert cpu_quant.half_exact(qa.scale, folded_minimum_of(qa))
    sym = quantize(w, "int8", axis, group=32)
    err, err_sym = np.abs(dequantize(qa) - w).max(), np.abs(dequantize(sym) - w).max()
    assert err < 0.1 * err_sym, (err, err_sym)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3, shape[-1]) + 0.5
    qa = quantize(x, "int8", axis, group=32, symmetric=False)
    u = qa.q.astype(np.int16) + qa.zero
    assert u.min() >= 0 and u.max() <= 255
    step = np.take(qa.scale, np.arange(shape[axis]) // 32, axis=axis)
    assert np.all(np.abs(dequantize(qa) - x) <= step / 2 * (1 + 1e-5) + 1e-7)


def folded_minimum_of(qa):
    return qa.m - np.float32(qa.zero) * qa.scale


def test_the_minimum_folds_exactly_at_every_magnitude():
    """m = lo + 128 s exactly (float64 says so), so the kernel's layout holds the QArray: ordinary groups keep
    their scale and minimum; a group whose sum would round (constant, far narrower than its values, float32
    scales and minima) takes a power-of-two scale and a minimum on its grid, its values still within half a
    step, codes 0..255 (per column, and groups of 16 of bfloat16 values whose tiny ranges force float32)."""
    rng = np.random.default_rng(7)
    lo = rng.normal(0, 0.05, 100_000).astype(np.float16).astype(np.float32)
    s = (rng.uniform(1e-4, 1e-2, 100_000) / 255).astype(np.float16).astype(np.float32)
    s2, lo2, m = folded_minimum(lo, lo + 255 * s, s, half=True)
    assert np.array_equal(s2, s) and np.array_equal(lo2, lo)
    np.testing.assert_array_equal(m.astype(np.float64) - 128 * s.astype(np.float64), lo)
    lo = (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-8, 4, 100_000)).astype(np.float32)
    hi = lo + np.abs(lo) * (10.0 ** rng.uniform(-12, 1, 100_000)).astype(np.float32) * rng.integers(0, 2, 100_000)
    for half in (True, False):
        s2, lo2, m = folded_minimum(lo, hi, np.where(hi > lo, (hi - lo) / 255, 1).astype(np.float32), half)
        np.testing.assert_array_equal(m.astype(np.float64) - 128 * s2.astype(np.float64), lo2)
        assert np.all(lo2 <= lo) and np.all((hi - lo2) / s2 <= 255.5)
    flat = np.full((65, 8), 1e-3, np.float32)  # constant groups (and a one-entry one at the end of K)
    # per column, float32 minima 1.75 + 2^-23: 128 s far below them
    w = (1.75 + 2.0 ** -23 + np.arange(64 * 8, dtype=np.float64).reshape(64, 8) * 2.0 ** -22).astype(np.float32)
    b16 = (rng.standard_normal((2, 64, 32)) * 0.02).astype(ml_dtypes.bfloat16).astype(np.float32)
    for x, group in ((flat, 32), (w, 0), (b16, 16)):
        qa = quantize(x, "int8", -2, group=group, symmetric=False)
        assert qa.m is not None and qa.zero == 128
        u = qa.q.astype(np.int16) + 128
        assert u.min() >= 0 and u.max() <= 255
        np.testing.assert_array_equal(qa.m.astype(np.float64) - 128 * qa.scale.astype(np.float64),
                                      folded_minimum_of(qa))
        step = np.take(qa.scale, np.arange(x.shape[-2]) // (group or x.shape[-2]), axis=-2)
        assert np.all(np.abs(dequantize(qa) - x) <= step / 2 * (1 + 1e-5))


@pytest.mark.skipif(not KERNEL, reason="the quantized CPU kernel cannot be built here")
@pytest.mark.parametrize("group", [32, 64, 0])
def test_packed_round_trip_product_and_rows(group):
    """QArray -> QPacked -> QArray is exact (the folded minimum unfolded); the kernel's product of layer 1 of
    a stack equals the float product of the activations rounded to its act_bits (int16 codes: int8 weights'
    default) per block of the group's k (up to 128: one scale a column takes blocks of 128) with the
    dequantized matrix (K not a multiple of the group, row and column tails); a tied
    embedding's rows read from the packed head."""
    rng = np.random.default_rng(group)
    for K, N, M in ((64, 48, 1), (100, 40, 5)):
        w = rng.standard_normal((3, K, N)).astype(np.float32) + 0.3
        qa = quantize(w, "int8", -2, "float32", group, symmetric=False)
        qp = qpacked.pack(jax.tree.map(jnp.asarray, qa))
        assert qp.layout.zero == 0 and qp.layout.has_min and qp.zero == 128
        back = qp.unpack()
        for a, b in ((back.q, qa.q), (back.scale, qa.scale), (back.m, qa.m)):
            np.testing.assert_array_equal(np.asarray(a), b)
        x = rng.standard_normal((M, K)).astype(np.float32)
        assert qp.act_bits == 16 and qp.act_outlier == qpacked.AUTO_ACT_OUTLIER[8]
        assert qp.layout.act_block == (group or {64: 64, 100: 128}[K])  # one scale a column: K=64 is a group
        ref = (int8_rounded(x, qp.layout.act_block, act_bits=16, outlier=qp.act_outlier)
               @ np.asarray(dequantize(qa))[1])
        got = np.asarray(qpacked.matmul(jnp.asarray(x), qp, layer=jnp.int32(1)))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    emb = quantize(rng.standard_normal((40, 64)).astype(np.float32), "int8", -1, "float32", group, symmetric=False)
    head = qpacked.pack(jax.tree.map(jnp.asarray, emb), transposed=True)
    ids = np.array([0, 17, 39, 17])
    np.testing.assert_allclose(np.asarray(qpacked.take_rows(head, jnp.asarray(ids), "float32")),
                               dequantize(emb)[ids], rtol=0, atol=1e-6)


@pytest.mark.skipif(not KERNEL, reason="the quantized CPU kernel cannot be built here")
def test_a_minimum_that_does_not_fold_is_refused():
    """`pack` refuses (naming the matrix and its zero code) a minimum m with m - 128 s not giving m back:
    the packed matrix would not be the QArray."""
    qa = quantize(np.linspace(-1, 1, 64 * 8, dtype=np.float32).reshape(64, 8), "int8", -2, group=32,
                  symmetric=False)
    odd = dataclasses.replace(qa, m=np.full_like(qa.m, 1e6) + np.float32(0.0625),
                              scale=np.full_like(qa.scale, 2.0 ** -20))
    with pytest.raises(ValueError, match=r"\[64, 8\] with zero code 128 has a minimum"):
        qpacked.pack(jax.tree.map(jnp.asarray, odd))


def test_engine_and_checkpoint_take_the_form():
    """int8 takes quantization_symmetric=False (fp8 does not: named), and has it by default, in groups of 32,
    on int16 activations (quantization_activation_bits: 8 or 16, else named); a saved int8 matrix with its
    minimum and form [group, 8, 128] restores as it was, a form with another zero and a minimum is refused."""
    assert EngineConfig(quantization="int8", quantization_symmetric=False).quantization_symmetric is False
    assert (group_of("int8", None), symmetric_of("int8", None)) == (32, False)
    assert (qpacked.act_bits_of(8), qpacked.act_bits_of(4), qpacked.act_bits_of(8, 8)) == (16, 8, 8)
    for bad in (12, "16"):
        with pytest.raises(ValueError, match="quantization_activation_bits must be"):
            EngineConfig(quantization="int8", quantization_activation_bits=bad)
        with pytest.raises(ValueError, match="quantization_activation_bits must be"):
            qpacked.act_bits_of(8, bad)
    with pytest.raises(ValueError, match="takes quantization 'int4' or 'int8', not 'fp8'"):
        EngineConfig(quantization="fp8", quantization_symmetric=False)
    qa = quantize(np.random.default_rng(1).standard_normal((70, 16)).astype(np.float32), "int8", -2, group=32,
                  symmetric=False)
    back = restored(qa.q, qa.scale, -2, qa.m, np.array([32, 8, 128]))
    for a, b in ((back.q, qa.q), (back.scale, qa.scale), (back.m, qa.m)):
        np.testing.assert_array_equal(a, b)
    assert (back.group, back.bits, back.zero) == (32, 8, 128)
    with pytest.raises(ValueError, match="with a minimum 0, or 128 for 8 bits"):
        restored(qa.q, qa.scale, -2, qa.m, np.array([32, 8, 100]))


@pytest.mark.skipif(not KERNEL, reason="the quantized CPU kernel cannot be built here")
def test_engine_on_the_kernel_matches_its_dequantized_weights(tmp_path, compile_cache):
    """A checkpoint loaded as int8 with a minimum (its matrices preallocated, then filled layer by layer) runs
    on the quantized kernel, its greedy tokens and logprobs those of its own weights dequantized to float32."""
    path = make_tiny_model(str(tmp_path / "m"), "llama", seed=6, initializer_range=0.1, tie=True)
    llm = LLM(model=path, dtype="float32", quantization="int8", quantization_group_size=32,
              quantization_symmetric=False, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              compilation_cache_dir=compile_cache, show_progress=False)
    assert llm.engine.stats()["matmul_backend"].startswith("cpu_quant")
    w_up = llm.engine.runner.params["layers"]["w_up"]
    assert isinstance(w_up, qpacked.QPacked) and w_up.zero == 128 and w_up.has_min and w_up.layout.zero == 0
    assert w_up.act_bits == 16  # int8 weights' default activations
    _check_against_float(llm, path)
