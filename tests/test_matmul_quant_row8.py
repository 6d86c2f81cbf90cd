"""The quantized CPU product's lone-row 8-bit path (pallas_kernels/matmul/cpu_quant_row8.h: one row, one-level
scales in groups of a multiple of 32 k, activation blocks of 32 k) against numpy and against the row-block path
of the same rows, for every 8-bit form it takes: int8's default (groups of 32 with a minimum, float16 scales),
Q8_0 (zero 128), Q5_0 (5-bit codes, zero 16), groups of 64 and 128, one scale per column, float32 scales; int8
activations, int16 ones everywhere, int16 ones in outlier blocks only and in none; units of 4 tiles and single
tiles, a partial last tile, K not a multiple of 32 or of the group, a lone row after the row blocks."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.testing.kernel_activations import int8_rounded
from pallas_kernels.matmul import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernel cannot be built here")
PATHS = [p for p in ("scalar", "avx2", "avx512_vnni") if cq.ISAS[p] <= cq.ISAS.get(cq.isa() or "scalar", 0)]
N = 16 * 9 + 5  # units of 4, 4 and 2 tiles, the last partial
M = 9  # rows 0..7 a block of 8 (int8 activations) or two of 4 (int16), row 8 alone
TAU = 1.5

FORMS = [  # K, group (0: one a column), code range, zero, has_min, scale_bytes
    (544, 32, 256, 0, True, 2),     # int8's default: groups of 32 with a minimum (zero folded into it)
    (544, 32, 256, 128, False, 2),  # Q8_0
    (200, 32, 32, 16, False, 2),    # Q5_0's codes; K past the last block of 32
    (300, 64, 256, 0, True, 2),     # groups of 64, K inside the last one
    (544, 128, 256, 128, False, 4),  # groups of 128, float32 scales
    (300, 0, 256, 128, False, 4),   # one scale a column (K padded to 384)
]
ACTS = {  # act_bits, act_outlier, activations
    "int8": (8, 0.0, "spiky"),
    "int16": (16, 0.0, "spiky"),
    "outlier blocks": (16, TAU, "spiky"),
    "no outlier block": (16, TAU, "flat"),
}


def packed(rng, K, group, top, zero, has_min, sb):
    """A random packed matrix of the form and the float64 [K, N] matrix it stands for."""
    layout = cq.Layout(K, N, group or K, 8, zero, has_min, sb)
    u = rng.integers(0, top, (K, N), dtype=np.uint8)
    s = rng.uniform(1e-3, 2e-2, layout.scale_shape).astype(np.float32)
    m = rng.normal(0, 0.05, s.shape).astype(np.float32) if has_min else None
    if sb == 2:
        s, m = (None if a is None else a.astype(np.float16).astype(np.float32) for a in (s, m))
    w = cq.pack(u, s, m, layout)
    return layout, w, np.asarray(cq.dequantize(w, layout), np.float64)


def activations(rng, K, kind):
    """Rows of M: "spiky" ones with large channels (every row: one; every third row: one more of its own),
    so each has blocks on both sides of the outlier cut; "flat" ones with every block's max near 1: none."""
    if kind == "flat":
        return rng.uniform(-1, 1, (M, K)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, 5] *= 30
    x[::3, rng.integers(0, K, -(-M // 3))] *= 12
    return x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("K,group,top,zero,has_min,sb", FORMS)
def test_lone_rows_equal_reference_and_row_blocks(K, group, top, zero, has_min, sb, act, path):
    """Each row alone equals the reference (its rounded activations times the dequantized matrix) to float32
    summation, and bit for bit the same row computed inside a block of rows (the same integer sums, the same
    float steps in the same order); a bfloat16 row too."""
    bits, tau, kind = ACTS[act]
    rng = np.random.default_rng(K + group + zero + 2 * has_min + sb + bits)
    layout, w, wd = packed(rng, K, group, top, zero, has_min, sb)
    x = activations(rng, K, kind)
    kw = dict(act_bits=bits, act_outlier=tau, isa=path)
    xr = int8_rounded(x, 32, bits, tau)
    wide = xr != int8_rounded(x, 32, 8)  # where int16 codes differ from int8 ones
    if act == "outlier blocks":
        assert wide.any() and not wide.all(axis=1).any()  # each row: both kinds of block
    if act == "no outlier block":
        assert not wide.any()
    want = xr.astype(np.float64) @ wd
    block = np.asarray(cq.cpu_quant_matmul(jnp.asarray(x), w, layout, **kw))
    np.testing.assert_allclose(block, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for r in range(M):
        alone = np.asarray(cq.cpu_quant_matmul(jnp.asarray(x[r:r + 1]), w, layout, **kw))[0]
        np.testing.assert_array_equal(alone, block[r], err_msg=f"row {r}")
    xb = jnp.asarray(x[1:2], jnp.bfloat16)
    got = np.asarray(cq.cpu_quant_matmul(xb, w, layout, **kw))[0]
    ref = (int8_rounded(np.asarray(xb, np.float32), 32, bits, tau).astype(np.float64) @ wd)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("path", PATHS)
def test_lone_rows_of_fused_products_and_a_stack(path):
    """Several matrices of one lone row in one call (the engine's q / k / v), each a stack read at a layer:
    each output the same bits as its own single call and as its row inside a block."""
    rng = np.random.default_rng(3)
    forms = [FORMS[0], (544, 32, 256, 128, False, 2), (544, 64, 256, 0, True, 2)]
    mats = [[packed(rng, *f) for _ in range(2)] for f in forms]  # two layers each
    ws = [jnp.stack([m[1] for m in pair]) for pair in mats]
    layouts = [pair[0][0] for pair in mats]
    x = activations(rng, 544, "spiky")
    kw = dict(act_bits=16, act_outlier=TAU, isa=path, layer=1)
    fused = cq.cpu_quant_matmuls(jnp.asarray(x[:1]), ws, layouts, **kw)
    for w, layout, pair, y in zip(ws, layouts, mats, fused):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(cq.cpu_quant_matmul(jnp.asarray(x[:1]), w, layout,
                                                                                     **kw)))
        block = np.asarray(cq.cpu_quant_matmul(jnp.asarray(x), w, layout, **kw))
        np.testing.assert_array_equal(np.asarray(y)[0], block[0])
        want = int8_rounded(x[:1], 32, 16, TAU).astype(np.float64) @ pair[1][2]
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
