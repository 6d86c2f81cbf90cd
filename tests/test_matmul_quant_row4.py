"""The quantized CPU product's lone-row 4-bit path (pallas_kernels/matmul/cpu_quant_row4.h: one row, scale
groups and activation blocks of 32 k) against numpy and against the row-block path of the same rows, for every
4-bit form it takes: int4 / Q4_0 (zero 8), int4 with a minimum / Q4_1, Q4_K's two-level form with and without a
minimum, float16 and float32 scales; units of 4 tiles and single tiles, a partial last tile, K past the last
superblock, lone rows after the row blocks."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import cpu_quant as cq
from pallas_kernels.matmul.two_level import two_level

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernel cannot be built here")
PATHS = [p for p in ("scalar", "avx2", "avx512_vnni") if cq.ISAS[p] <= cq.ISAS.get(cq.isa() or "scalar", 0)]
K, N = 544, 16 * 9 + 5  # 17 groups of 32 (two superblocks and a part); units of 4, 4 and 2 tiles, the last partial

FORMS = [  # zero, has_min, scale_bytes, superblock
    (8, False, 2, 0),     # Q4_0 / symmetric int4
    (0, True, 2, 0),      # Q4_1 / int4 with a minimum (float16 scales)
    (0, False, 4, 0),     # zero 0, float32 scales
    (0, True, 2, 256),    # Q4_K's two-level form
    (8, False, 4, 256),   # two-level without a minimum, float32 d
]


def packed(rng, zero, has_min, sb, superblock):
    """A packed matrix of the form, and its float64 [K, N] values."""
    layout = cq.Layout(K, N, 32, 4, zero, has_min, sb, superblock)
    gs = layout.scale_shape[0]
    u = rng.integers(0, 16, (K, N), dtype=np.uint8)

    def part(lo, hi):  # float16 d per 256 k times an int8 per group: the two-level form's values
        d = rng.uniform(1e-4, 1e-2, (-(-K // 256), N)).astype(np.float16).astype(np.float32)
        return d[np.arange(gs) // 8] * rng.integers(lo, hi, (gs, N)).astype(np.float32)
    s, m = part(1, 64), (-part(0, 64) if has_min else None)
    if not superblock and sb == 2:
        s, m = (None if a is None else a.astype(np.float16).astype(np.float32) for a in (s, m))
    idx = np.arange(K) // 32
    wd = s.astype(np.float64)[idx] * (u.astype(np.float64) - zero) + (0 if m is None else m.astype(np.float64)[idx])
    if superblock:
        s, m = two_level(s, layout), (None if m is None else two_level(m, layout))
    return layout, cq.pack(u, s, m, layout), wd


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("zero,has_min,sb,superblock", FORMS)
def test_lone_rows_equal_reference_and_row_blocks(zero, has_min, sb, superblock, path):
    """Each row alone equals the reference (int8 activations times the dequantized matrix) to float32
    summation, and the same row computed inside a block of 4 rows: bit for bit for one-level scales (the same
    float steps in the same order), to float32 rounding for two-level ones (a block multiplies d * c first)."""
    from test_matmul_quant_cpu import int8_activations
    rng = np.random.default_rng(zero + 2 * has_min + sb + superblock)
    layout, w, wd = packed(rng, zero, has_min, sb, superblock)
    x = rng.standard_normal((5, K)).astype(np.float32)
    want = int8_activations(x, cq.Layout(K, N, 32, 4, zero, has_min), 32) @ wd
    block = np.asarray(cq.cpu_quant_matmul(jnp.asarray(x), w, layout, isa=path))  # rows 0..3 a block, row 4 alone
    for r in range(5):
        xr = jnp.asarray(x[r:r + 1], (jnp.float32, jnp.bfloat16)[r == 2])
        alone = np.asarray(cq.cpu_quant_matmul(xr, w, layout, isa=path))[0]
        ref = want[r] if r != 2 else (int8_activations(np.asarray(xr, np.float32), cq.Layout(K, N, 32, 4, zero,
                                                                                            has_min), 32) @ wd)[0]
        np.testing.assert_allclose(alone, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        if r == 2:
            continue
        if superblock:
            np.testing.assert_allclose(alone, block[r], rtol=1e-6, atol=1e-6 * np.abs(block[r]).max())
        else:
            np.testing.assert_array_equal(alone, block[r])
    np.testing.assert_allclose(block, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
