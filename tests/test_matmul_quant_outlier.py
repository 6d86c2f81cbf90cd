"""The quantized CPU product with int16 activation codes in a row's outlier blocks only (`act_outlier`,
int8 weights' default: pallas_kernels/matmul/cpu_quant.py) against numpy, on every path this build has, and
a row's outputs the same bits alone and among rows whose second plane of dots runs."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.testing.kernel_activations import int8_rounded
from pallas_kernels.matmul import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernel cannot be built here")
PATHS = [p for p in ("scalar", "avx2", "avx512_vnni") if cq.ISAS[p] <= cq.ISAS.get(cq.isa() or "scalar", 0)]
TAU = 1.5

CASES = [  # M, K, N, group, bits, zero, has_min: K and N tails, row tails of the blocks of 8 and 4
    (1, 64, 16, 32, 8, 0, True), (9, 200, 100, 32, 8, 128, False), (17, 300, 40, 64, 8, 0, True),
    (13, 96, 24, 16, 4, 0, True), (64, 512, 48, 128, 8, 128, False), (6, 130, 33, 130, 8, 0, True),
]


def packed(rng, layout):
    """A random packed matrix of the layout (float16 scales) and the float64 matrix it stands for."""
    u = rng.integers(0, 2 ** layout.bits, (layout.K, layout.N), dtype=np.uint8)
    s = rng.uniform(1e-3, 2e-2, layout.scale_shape).astype(np.float16).astype(np.float32)
    m = rng.normal(0, 0.05, s.shape).astype(np.float16).astype(np.float32) if layout.has_min else None
    w = cq.pack(u, s, m, layout)
    return w, np.asarray(cq.dequantize(w, layout), np.float64)


def activations(rng, M, K):
    """Rows with a few large channels (every row: column 5; some rows: one more of their own), so each row
    has blocks on both sides of the cut."""
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, 5 % K] *= 30
    x[::3, rng.integers(0, K, -(-M // 3))] *= 12
    return x


def outliers(x, block):
    """Which blocks of each row take int16 codes at TAU: the reference's own rule, counted for the test."""
    wide = int8_rounded(x, block, 16, TAU) != int8_rounded(x, block, 8)
    M, K = x.shape
    return np.pad(wide, [(0, 0), (0, -K % block)]).reshape(M, -1, block).any(-1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,K,N,group,bits,zero,has_min", CASES)
def test_outlier_blocks_equal_reference(M, K, N, group, bits, zero, has_min, path):
    """int16 codes where a block's max|x| x the row's block count exceeds TAU x the sum of its block maxima,
    int8 codes elsewhere, exactly as the reference rounds them (float32 and bfloat16 x, activation blocks of
    32 and, on the best path, 128); the error lies between int16's everywhere and int8's."""
    rng = np.random.default_rng(M * K + N)
    layout = cq.Layout(K, N, group, bits, zero, has_min, 2)
    w, wd = packed(rng, layout)
    x = jnp.asarray(activations(rng, M, K), (jnp.float32, jnp.bfloat16)[M % 2])
    xf = np.asarray(x, np.float32)
    for block in (32, 128) if path == PATHS[-1] else (32,):
        mask = outliers(xf, block)
        assert K <= block or (mask.any() and not mask.all())  # both kinds of block in play (one: int8 codes)
        got = np.asarray(cq.cpu_quant_matmul(x, w, layout, act_block=block, act_bits=16, act_outlier=TAU, isa=path))
        want = int8_rounded(xf, block, 16, TAU).astype(np.float64) @ wd
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(block))
        exact = xf.astype(np.float64) @ wd
        err = {b: np.linalg.norm(int8_rounded(xf, block, b).astype(np.float64) @ wd - exact) for b in (8, 16)}
        assert err[16] <= np.linalg.norm(got - exact) <= err[8] * 1.001


@pytest.mark.parametrize("path", PATHS)
def test_a_row_alone_and_among_others_is_the_same(path):
    """The second plane of dots runs for a block of rows where any of them has int16 codes there: a row
    with none (rows 0-2, 4-15: no outlier), or with its own (row 3), gives the same bits alone as in the
    call of 16 rows, and the reference's values."""
    rng = np.random.default_rng(11)
    layout = cq.Layout(256, 64, 32, 8, 0, True, 2)
    w, wd = packed(rng, layout)
    x = rng.uniform(-1, 1, (16, 256)).astype(np.float32)  # every block's max close to 1: no outliers
    x[3, 40] = 40.0
    assert outliers(x, 32).sum() == 1
    run = lambda a: np.asarray(cq.cpu_quant_matmul(jnp.asarray(a), w, layout, act_bits=16,  # noqa: E731
                                                   act_outlier=TAU, isa=path))
    together = run(x)
    for r in range(16):
        np.testing.assert_array_equal(run(x[r:r + 1])[0], together[r], err_msg=f"row {r}")
    want = int8_rounded(x, 32, 16, TAU).astype(np.float64) @ wd
    np.testing.assert_allclose(together, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_packer_gives_int8_weights_the_outlier_rule():
    """int8 weights with no chosen width: int16 codes at AUTO_ACT_OUTLIER's cut; a chosen width (the engine's
    quantization_activation_bits) one width everywhere; int4 int8 codes; bad choices named."""
    from jaxpaged.models import qpacked
    assert qpacked.AUTO_ACT_OUTLIER[8] > 0 and qpacked.AUTO_ACT_OUTLIER[4] == 0
    for bits, choice, want in ((8, None, (16, qpacked.AUTO_ACT_OUTLIER[8])), (8, 16, (16, 0.0)), (8, 8, (8, 0.0)),
                               (4, None, (8, 0.0)), (4, 16, (16, 0.0))):
        assert (qpacked.act_bits_of(bits, choice), qpacked.act_outlier_of(bits, choice)) == want, (bits, choice)
    with pytest.raises(ValueError, match="quantization_activation_bits"):
        qpacked.act_outlier_of(8, 12)
