"""GGUF quantized tensors map onto the engine's quantized format exactly: s * (u - z) + m equals
gguf.quants.dequantize's float32 matrix bit for bit, per type and over many shapes."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from jaxpaged.checkpoints.gguf_quant import GGUF_QUANT_TYPES, gguf_codes
from jaxpaged.testing.kernel_activations import int8_rounded

# gguf-py quantizes these; the K-quant blocks are written from their layout (random codes, sane scales)
QUANTIZED_BY_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
SHAPES = ((1, 256), (3, 256), (16, 512), (40, 768), (7, 1024), (64, 256))  # (N, K)


def gguf_matrix(type_name, n, k, seed=0):
    """Raw GGUF data uint8 [N, K / block * bytes] of a matrix of this type."""
    rng = np.random.default_rng(seed)
    block, nbytes, _, _ = GGUF_QUANT_TYPES[type_name]
    if type_name in QUANTIZED_BY_GGUF:
        w = rng.normal(0, 0.02, (n, k)).astype(np.float32)
        w[0, :block] += 0.5  # one block far from zero: the minimum / scale of a skewed block
        return quantize(w, GGMLQuantizationType[type_name])
    blocks = rng.integers(0, 256, (n * k // block, nbytes), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, (len(blocks), 2)).astype(np.float16).view(np.uint8)  # finite d (and dmin)
    if type_name == "Q6_K":
        blocks[:, 208:210] = d[:, :2]
    else:
        blocks[:, 0:4] = d
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
@pytest.mark.parametrize("n,k", SHAPES)
def test_codes_equal_gguf_dequantize_bit_for_bit(type_name, n, k):
    data = gguf_matrix(type_name, n, k, seed=n * k)
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(n, k)  # float32 [N, K]
    c = gguf_codes(data, type_name, k)
    block, _, group, bits = GGUF_QUANT_TYPES[type_name]
    assert c.u.shape == (k, n) and c.u.dtype == np.uint8 and int(c.u.max()) < 2 ** bits
    assert c.s.shape == (k // group, n) and c.s.dtype == np.float32 and c.group == group and c.bits == bits
    assert (c.m is None) == (type_name in ("Q8_0", "Q4_0", "Q5_0", "Q6_K"))
    got = c.dequantize()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.T, want)


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
def test_codes_use_the_whole_code_range(type_name):
    """Random blocks reach both ends of the codes: a mapping dropping a high bit would fail above."""
    n, k = 64, 1024
    c = gguf_codes(gguf_matrix(type_name, n, k, seed=1), type_name, k)
    top = {"Q8_0": 200, "Q5_0": 31, "Q5_1": 31, "Q5_K": 31, "Q6_K": 63}.get(type_name, 15)  # value bits
    assert int(c.u.max()) >= top and int(c.u.min()) <= (0 if type_name != "Q8_0" else 55)


def test_bad_inputs_named():
    data = gguf_matrix("Q4_0", 4, 256)
    with pytest.raises(ValueError, match="GGUF type Q2_K has no quantized mapping"):
        gguf_codes(data, "Q2_K", 256)
    with pytest.raises(ValueError, match=r"GGUF Q4_0 data of shape \(4, 144\) is not rows of 512 inputs"):
        gguf_codes(data, "Q4_0", 512)
    with pytest.raises(ValueError, match="not rows of 100 inputs"):
        gguf_codes(data, "Q4_0", 100)


# -- the engine's leaf ----------------------------------------------------------------------------
@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
@pytest.mark.parametrize("n,k", [(40, 768), (16, 512)])
def test_engine_product_equals_float_product(type_name, n, k):
    """x @ the QArray made from the codes equals x @ gguf.quants.dequantize's matrix within float32
    rounding; the QArray stands for that matrix exactly."""
    import jax.numpy as jnp

    from jaxpaged.models.qarray import QArray
    from jaxpaged.models.qarray import dequantize as engine_matrix
    from jaxpaged.models.quant import dot
    data = gguf_matrix(type_name, n, k, seed=7)
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(n, k)  # float32 [N, K]
    c = gguf_codes(data, type_name, k)
    qa = QArray.from_codes(c.u, c.s, c.m, zero=c.zero, group=c.group, bits=c.bits)
    assert qa.bits == c.bits and qa.group == c.group
    np.testing.assert_array_equal(np.asarray(engine_matrix(qa)), want.T)
    x = np.random.default_rng(k).normal(0, 1, (5, k)).astype(np.float32)
    y = np.asarray(dot(jnp.asarray(x), QArray(jnp.asarray(qa.q), jnp.asarray(qa.scale), "float32",
                                               None if qa.m is None else jnp.asarray(qa.m), qa.group, qa.bits,
                                               qa.zero)))
    ref = x.astype(np.float64) @ want.T.astype(np.float64)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("types,form", [(("Q4_K", "Q6_K"), (16, 8, 0, True)),       # Q4_K_M's mix
                                        (("Q8_0", "Q4_0", "Q5_0"), (32, 8, 128, False)),
                                        (("Q4_0", "Q4_1"), (32, 4, 0, True)),
                                        (("Q4_0",), (32, 4, 8, False)), (("Q5_K",), (32, 8, 0, True))])
def test_mixed_types_share_one_exact_form(types, form):
    """A stacked matrix whose layers have different GGUF types takes one form they all fit: each layer's
    matrix is its codes' matrix (a zero folded into a minimum: within float rounding)."""
    from jaxpaged.checkpoints.gguf_load import leaf_form, store_codes
    from jaxpaged.models.qarray import QArray
    from jaxpaged.models.qarray import dequantize as engine_matrix
    assert leaf_form(set(types)) == form
    group, bits, zero, has_m = form
    n, k = 24, 512
    codes = [gguf_codes(gguf_matrix(t, n, k, seed=i), t, k) for i, t in enumerate(types)]
    dst = (np.empty((len(types), k, n), np.uint8), np.empty((len(types), k // group, n), np.float32),
           np.empty((len(types), k // group, n), np.float32) if has_m else None)
    for i, c in enumerate(codes):
        store_codes(dst, form, (i,), c, None, f"layer {i}", "test")
    w = np.asarray(engine_matrix(QArray.from_codes(*dst, zero=zero, group=group, bits=bits)))
    for i, c in enumerate(codes):
        want = c.dequantize()
        if c.m is None and has_m:
            np.testing.assert_allclose(w[i], want, rtol=0, atol=2e-7 * np.abs(want).max())
        else:
            np.testing.assert_array_equal(w[i], want)


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
@pytest.mark.parametrize("n,k", [(40, 768), (7, 1024)])
def test_packed_layout_and_product_per_type(type_name, n, k):
    """Each type's codes packed for the quantized CPU kernel: scales and minima in float16 (2 bytes) for the
    legacy types, whose d and min the file stores as float16; for the K-quants (d times a sub-scale is
    generally no float16) the two-level form, the file's float16 d (dmin) per 256 k and an int8 sub-scale
    (sub-minimum) per group, at under 5 bits a weight for Q4_K. Unpacked, the matrix is
    gguf.quants.dequantize's bit for bit, and the kernel's product equals the int8-rounded activations (per
    32 entries) times it within float32 rounding, as does the one-level float32 layout's product."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models import qpacked
    from jaxpaged.models.qarray import QArray
    from jaxpaged.models.qarray import dequantize as engine_matrix
    from pallas_kernels.matmul import cpu_quant
    if not cpu_quant.available():
        pytest.skip("the quantized CPU kernel cannot be built here")
    data = gguf_matrix(type_name, n, k, seed=11)
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(n, k).T  # float32 [K, N]
    c = gguf_codes(data, type_name, k)
    qa = jax.tree.map(jnp.asarray, QArray.from_codes(c.u, c.s, c.m, zero=c.zero, group=c.group, bits=c.bits))
    qp = qpacked.pack(qa)
    assert (qp.superblock, qp.scale_bytes) == ((256, 2) if type_name.endswith("_K") else (0, 2)), qp
    if type_name == "Q4_K":
        assert qp.blob.size * 8 / (k * 16 * qp.layout.tiles) == 4 + (2 * 8 + 2 * 2 * 8 / 8) / 32  # 4.625 bits
    np.testing.assert_array_equal(np.asarray(engine_matrix(qp.unpack())), want)
    x = np.random.default_rng(k).normal(0, 1, (5, k)).astype(np.float32)
    ref = int8_rounded(x, act_bits=qp.act_bits, outlier=qp.act_outlier).astype(np.float64) @ want.astype(np.float64)
    got = np.asarray(qpacked.matmul(jnp.asarray(x), qp))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    one = qpacked.pack(qa, scale_bytes=4, superblock=0)
    np.testing.assert_allclose(got, np.asarray(qpacked.matmul(jnp.asarray(x), one)), rtol=1e-5,
                               atol=1e-6 * np.abs(ref).max())


def test_two_level_form_only_where_smaller_or_asked():
    """The packer takes the two-level form where the scales have one and it is the smaller blob: K = 288 (9
    groups, two superblocks) stays one-level unless asked; scales without the form are refused when asked."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxpaged.models import qpacked
    from jaxpaged.models.qarray import QArray
    rng = np.random.default_rng(9)
    d = rng.uniform(1e-4, 1e-2, (2, 48)).astype(np.float16).astype(np.float32)
    s = d[np.arange(9) // 8] * rng.integers(1, 64, (9, 48)).astype(np.float32)
    qa = jax.tree.map(jnp.asarray, QArray.from_codes(rng.integers(0, 16, (288, 48), dtype=np.uint8), s, -s,
                                                     zero=0, group=32, bits=4))
    one, two = qpacked.pack(qa), qpacked.pack(qa, superblock=256)
    assert (one.superblock, two.superblock) == (0, 256) and two.blob.size > one.blob.size
    np.testing.assert_array_equal(np.asarray(two.unpack().scale), s)
    odd = dataclasses.replace(qa, scale=qa.scale * jnp.float32(1 + 2 ** -20))
    with pytest.raises(ValueError, match="superblock=256"):
        qpacked.pack(odd, superblock=256)
