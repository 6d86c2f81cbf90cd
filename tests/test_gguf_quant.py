"""GGUF quantized tensors map onto the engine's quantized format exactly: s * (u - z) + m equals
gguf.quants.dequantize's float32 matrix bit for bit, per type and over many shapes."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from jaxpaged.checkpoints.gguf_quant import GGUF_QUANT_TYPES, gguf_codes

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
