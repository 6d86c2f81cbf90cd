"""Quantized KV pools (int8, float8_e4m3fn; and bfloat16 pools under float32 queries): quantization
error bounds, the reference over quantized pools against the reference over their dequantized float32
copies (so the scales are applied exactly once, where they belong), both Pallas kernels (interpret mode on
CPU) against the reference, stale scales, and the errors for missing or malformed scales."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.step.kv_cache import dequantize, quantize
from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests.test_paged_attention_kernels import dense_attention, make_case, ragged_case

QUANT = ("int8", "float8_e4m3fn")


def quantized(case, dtype):
    """The case with its pools quantized: values, scales, and the dequantized float32 pools."""
    out = dict(case)
    deq = {}
    for name in ("k_pool", "v_pool"):
        values, scale = quantize(case[name], dtype)
        out[name], out[name[0] + "_scale"] = values, scale
        deq[name] = dequantize(values, scale)
    return out, deq


@pytest.mark.parametrize("dtype", QUANT)
def test_quantize_error_bounds(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 3, 64)) * 5, jnp.float32)
    x = x.at[0, 0].set(0.0)  # an all-zero row: scale 0, values 0, no NaN
    values, scale = quantize(x, dtype)
    assert values.dtype == jnp.dtype(dtype) and scale.shape == (64, 3) and scale.dtype == jnp.float32
    err = np.abs(np.asarray(dequantize(values, scale) - x))
    amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    if dtype == "int8":  # rounding to nearest: half a step
        assert np.all(err <= amax / 127 / 2 + 1e-6)
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 (normals); subnormal steps near 0 are tiny
        assert np.all(err <= np.abs(np.asarray(x)) / 16 + amax / 448 * 2 ** -9 + 1e-7)
    assert float(scale[0, 0]) == 0.0 and not np.any(np.asarray(dequantize(values, scale))[0, 0])
    assert np.asarray(dequantize(values, scale)).max() > 0.9 * float(jnp.max(x))  # the range is used


@pytest.mark.parametrize("dtype", QUANT)
def test_reference_on_quantized_pools_equals_dequantized(dtype):
    case, _ = ragged_case(1)
    qc, deq = quantized(case, dtype)
    got = ragged_paged_attention_reference(**qc)
    want = ragged_paged_attention_reference(**{**case, **deq})
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    dense = dense_attention(**{**case, **deq})
    np.testing.assert_allclose(got, dense, atol=1e-4, rtol=1e-4)
    # and the quantization costs little against the unquantized pools
    err = np.abs(np.asarray(got) - np.asarray(ragged_paged_attention_reference(**case))).max()
    assert err < (0.05 if dtype == "int8" else 0.2), err


@pytest.mark.parametrize("dtype", QUANT)
def test_stale_scales_never_reach_the_output(dtype):
    case, used = make_case(2, [1, 15, 17, 0, 40])
    qc, _ = quantized(case, dtype)
    want = paged_attention_reference(**qc)
    for name in ("k_scale", "v_scale"):
        qc[name] = jnp.where(jnp.asarray(used)[..., None], qc[name], jnp.nan)
    np.testing.assert_array_equal(paged_attention_reference(**qc), want)
    np.testing.assert_allclose(paged_attention(**qc, interpret=True), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", QUANT + ("bfloat16",))
@pytest.mark.parametrize("group", [1, 4])
def test_decode_kernel_matches_reference(dtype, group):
    case, _ = make_case(3, [1, 15, 16, 17, 53, 0, 80], group=group)
    if dtype == "bfloat16":  # a bfloat16 pool under float32 queries: the dots run in bfloat16
        qc = {**case, "k_pool": case["k_pool"].astype(jnp.bfloat16), "v_pool": case["v_pool"].astype(jnp.bfloat16)}
        tol = dict(atol=2e-2, rtol=2e-2)
    else:  # the values widen exactly; the dots run in q's dtype (float32 here)
        qc, _ = quantized(case, dtype)
        tol = dict(atol=1e-4, rtol=1e-4)
    want = paged_attention_reference(**qc)
    for knobs in ({}, dict(num_splits=3, blocks_per_iter=1)):
        np.testing.assert_allclose(paged_attention(**qc, interpret=True, **knobs), want, **tol)


@pytest.mark.parametrize("dtype", QUANT + ("bfloat16",))
def test_ragged_kernel_matches_reference(dtype):
    case, _ = ragged_case(4, group=2)
    if dtype == "bfloat16":
        qc = {**case, "k_pool": case["k_pool"].astype(jnp.bfloat16), "v_pool": case["v_pool"].astype(jnp.bfloat16)}
        tol = dict(atol=2e-2, rtol=2e-2)
    else:
        qc, _ = quantized(case, dtype)
        tol = dict(atol=1e-4, rtol=1e-4)
    want = ragged_paged_attention_reference(**qc)
    np.testing.assert_allclose(ragged_paged_attention(**qc, interpret=True), want, **tol)
    np.testing.assert_allclose(ragged_paged_attention(**qc, interpret=True, block_q=8, blocks_per_iter=1),
                               want, **tol)
    np.testing.assert_allclose(ragged_paged_attention_reference(**qc, window=20, softcap=30.0),
                               ragged_paged_attention(**qc, interpret=True, window=20, softcap=30.0), **tol)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
def test_scales_are_checked(fn):
    case, _ = make_case(5, [3, 20])
    qc, _ = quantized(case, "int8")
    kw = dict(interpret=True) if fn is paged_attention else {}
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        fn(**{**qc, "v_scale": None}, **kw)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        fn(**case, k_scale=qc["k_scale"], v_scale=qc["v_scale"], **kw)  # float pools take no scales
    with pytest.raises(ValueError, match="k_scale must be float32"):
        fn(**{**qc, "k_scale": qc["k_scale"][:, :, :1]}, **kw)
