"""The quantized CPU product's many-row path (pallas_kernels/matmul/cpu_quant_blocks.h: blocks of 7 rows of
8-bit codes / 6 of 4-bit, one-level formats whose scale group is a multiple of the activation block: groups of
32, 64, 128 and one scale a column, blocks of 32 to 128 k; int8 or int16 activation codes) against numpy, a
row's outputs the same bits alone (the lone-row path) and in a block of rows, and each product of a
multi-matrix call the same as alone."""
import jax.numpy as jnp
import numpy as np
import pytest
from test_matmul_quant_outlier import packed

from jaxpaged.testing.kernel_activations import int8_rounded
from pallas_kernels.matmul import cpu_quant as cq

pytestmark = pytest.mark.skipif(cq.isa() != "avx512_vnni", reason="the many-row path is AVX-512 VNNI's")
TAU = 1.5

CASES = [  # M, K, N, bits, zero, has_min, scale_bytes, act_bits, tau: row tails of 7 / 6, K and N tails
    (7, 64, 16, 8, 0, True, 2, 16, TAU), (13, 200, 100, 8, 128, False, 4, 16, TAU),
    (22, 288, 40, 8, 0, True, 2, 16, 0.0), (14, 96, 33, 8, 128, False, 2, 8, 0.0),
    (64, 512, 48, 8, 0, True, 2, 16, TAU), (15, 130, 24, 8, 0, True, 4, 8, 0.0), (6, 64, 16, 4, 0, True, 2, 8, 0.0),
    (13, 200, 100, 4, 8, False, 4, 8, 0.0), (20, 288, 40, 4, 0, True, 2, 8, 0.0),
]
WIDER = [  # M, K, N, bits, zero, has_min, scale_bytes, act_bits, tau, group (0: one a column), act_block
    (14, 300, 40, 8, 0, True, 2, 16, TAU, 64, 64), (15, 520, 33, 8, 128, False, 2, 8, 0.0, 128, 128),
    (13, 200, 40, 8, 128, False, 4, 16, TAU, 0, 128), (8, 256, 17, 8, 0, True, 4, 8, 0.0, 0, 128),
    (12, 300, 40, 4, 0, True, 2, 8, 0.0, 128, 128), (13, 260, 20, 4, 8, False, 4, 8, 0.0, 0, 128),
    (9, 300, 24, 8, 0, True, 2, 16, 0.0, 128, 32), (7, 136, 16, 8, 128, False, 4, 16, TAU, 0, 64),
]


def activations(rng, M, K):
    """Rows with a large channel in every row (column 5: a block where every row of a block has int16 codes),
    one more in every third row (blocks where only some rows have them), the rest blocks of int8 codes."""
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, 5] *= 30
    x[::3, rng.integers(32, K, -(-M // 3))] *= 12
    return x


@pytest.mark.parametrize("M,K,N,bits,zero,has_min,sb,act_bits,tau", CASES)
def test_many_rows_equal_reference(M, K, N, bits, zero, has_min, sb, act_bits, tau):
    """Every row (the full blocks on the many-row path, the tail on the others) equals the reference: x rounded
    per 32 k as the kernel rounds it, times the dequantized W, up to float32 summation."""
    rng = np.random.default_rng(M * K + N + bits)
    layout = cq.Layout(K, N, 32, bits, zero, has_min, sb)
    w, wd = packed(rng, layout)
    x = jnp.asarray(activations(rng, M, K), (jnp.float32, jnp.bfloat16)[M % 2])
    xf = np.asarray(x, np.float32)
    got = np.asarray(cq.cpu_quant_matmul(x, w, layout, act_bits=act_bits, act_outlier=tau))
    want = int8_rounded(xf, 32, act_bits, tau).astype(np.float64) @ wd
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("M,K,N,bits,zero,has_min,sb,act_bits,tau,group,block", WIDER)
def test_wider_blocks_equal_reference(M, K, N, bits, zero, has_min, sb, act_bits, tau, group, block):
    """Scale groups of 64 / 128 / a whole column, activation blocks up to the group: the many-row path's blocks
    equal the reference, x rounded per `block` k, as above."""
    rng = np.random.default_rng(M * K + N + bits + group)
    layout = cq.Layout(K, N, group or K, bits, zero, has_min, sb)
    w, wd = packed(rng, layout)
    x = jnp.asarray(activations(rng, M, K), (jnp.float32, jnp.bfloat16)[M % 2])
    xf = np.asarray(x, np.float32)
    got = np.asarray(cq.cpu_quant_matmul(x, w, layout, act_block=block, act_bits=act_bits, act_outlier=tau))
    want = int8_rounded(xf, block, act_bits, tau).astype(np.float64) @ wd
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bits,zero,has_min,act_bits,tau,group,block", [
    (8, 0, True, 16, TAU, 32, 32), (8, 128, False, 16, 0.0, 32, 32), (8, 128, False, 8, 0.0, 32, 32),
    (4, 0, True, 8, 0.0, 32, 32), (8, 0, True, 16, TAU, 128, 128), (8, 128, False, 16, TAU, 0, 128),
    (4, 8, False, 8, 0.0, 0, 128), (8, 0, True, 8, 0.0, 64, 32)])
def test_a_row_alone_and_in_a_block_is_the_same(bits, zero, has_min, act_bits, tau, group, block):
    """Each of 15 rows (two blocks of 7 / 6 and a tail; blocks whose low planes run for every row, for some, for
    none) gives the same bits alone, on the lone-row path, as in the call of all 15."""
    rng = np.random.default_rng(bits + act_bits)
    layout = cq.Layout(288, 40, group or 288, bits, zero, has_min, 2 if group else 4)
    w, _ = packed(rng, layout)
    x = activations(rng, 15, 288)
    run = lambda a: np.asarray(cq.cpu_quant_matmul(jnp.asarray(a), w, layout, act_block=block,  # noqa: E731
                                                   act_bits=act_bits, act_outlier=tau))
    together = run(x)
    for r in range(15):
        np.testing.assert_array_equal(run(x[r:r + 1])[0], together[r], err_msg=f"row {r}")


def test_each_product_of_one_call_is_the_same_alone():
    """One call of an 8-bit, a 4-bit (rows in blocks of 7 and of 6) and a group-64 matrix (the general path):
    each product the same bits as its own call."""
    rng = np.random.default_rng(5)
    layouts = (cq.Layout(256, 48, 32, 8, 0, True, 2), cq.Layout(256, 40, 32, 4, 0, True, 2),
               cq.Layout(256, 33, 64, 8, 128, False, 4))
    ws = [packed(rng, layout)[0] for layout in layouts]
    x = jnp.asarray(activations(rng, 20, 256))
    for act_bits, tau in ((16, TAU), (8, 0.0)):  # int16 codes: the 4-bit matrix on the general path
        together = cq.cpu_quant_matmuls(x, ws, layouts, act_bits=act_bits, act_outlier=tau)
        for w, layout, got in zip(ws, layouts, together):
            alone = cq.cpu_quant_matmul(x, w, layout, act_bits=act_bits, act_outlier=tau)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(alone), err_msg=f"{layout} {act_bits}")
