"""The quantized CPU product's two-level scale form (`Layout.superblock` 256: a float d per 256 k and column,
an int8 sub-scale per group; GGUF's K-quants) against numpy and against the one-level float32 layout of the
same scales, on every path this build has; `two_level`'s factorization; the operands it refuses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import cpu_quant as cq
from pallas_kernels.matmul.two_level import two_level

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernel cannot be built here")
PATHS = [p for p in ("scalar", "avx2", "avx512_vnni") if cq.ISAS[p] <= cq.ISAS.get(cq.isa() or "scalar", 0)]

CASES = [  # M, K, N, group, bits, zero, has_min, scale_bytes (d's)
    (1, 512, 40, 32, 4, 0, True, 2),     # Q4_K's form, a lone row, a partial tile
    (5, 768, 48, 32, 8, 0, True, 4),     # Q5_K's (8-bit codes), float32 d
    (9, 512, 33, 16, 8, 32, False, 2),   # Q6_K's (group 16, zero 32, signed sub-scales)
    (3, 300, 20, 64, 4, 8, False, 4),    # K not a multiple of the superblock (nor of the group)
    (13, 256, 16, 128, 4, 0, True, 2),   # two groups a superblock, row tails of every row block
]


def two_level_weights(rng, layout):
    """Codes, and float32 scales and minima [groups, N] that are float16 d (dm) times int8 sub-scales: the
    values a K-quant file gives."""
    gs, nsub = layout.scale_shape[0], layout.subgroups
    u = rng.integers(0, 2 ** layout.bits, (layout.K, layout.N), dtype=np.uint8)

    def part(lo, hi):
        d = rng.uniform(1e-4, 1e-2, (layout.groups, layout.N)).astype(np.float16).astype(np.float32)
        return d[np.arange(gs) // nsub] * rng.integers(lo, hi, (gs, layout.N)).astype(np.float32)
    s = part(-128, 128) if layout.zero else part(0, 64)
    return u, s, (-part(0, 64) if layout.has_min else None)


def flat(layout):
    """The one-level float32 layout of the same matrix."""
    return cq.Layout(layout.K, layout.N, layout.group, layout.bits, layout.zero, layout.has_min)


def packed(rng, layout):
    u, s, m = two_level_weights(rng, layout)
    st, mt = two_level(s, layout), None if m is None else two_level(m, layout)
    assert st is not None and (mt is None) == (m is None)
    return u, s, m, cq.pack(u, st, mt, layout)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,K,N,group,bits,zero,has_min,sb", CASES)
def test_two_level_product_equals_reference(M, K, N, group, bits, zero, has_min, sb, path):
    """d * c formed in registers: the product equals the int8 activations times the dequantized matrix, and
    the one-level float32 layout's product of the same scales, to float32 summation (one row, on AVX-512,
    sums a superblock's groups before multiplying by d)."""
    from test_matmul_quant_cpu import dense, int8_activations
    rng = np.random.default_rng(M * K + N)
    layout = cq.Layout(K, N, group, bits, zero, has_min, sb, superblock=256)
    u, s, m, w = packed(rng, layout)
    one = flat(layout)
    w1 = cq.pack(u, s, m, one)
    assert w.size < w1.size or K % 256, (w.size, w1.size)
    wd = dense(u, s, m, one)
    x = jnp.asarray(rng.standard_normal((M, K)), (jnp.float32, jnp.bfloat16)[M % 2])
    for act_block in (32, 128) if path == PATHS[-1] else (32,):
        got = np.asarray(cq.cpu_quant_matmul(x, w, layout, act_block=act_block, isa=path))
        want = int8_activations(np.asarray(x, np.float32), one, act_block) @ wd
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        same = np.asarray(cq.cpu_quant_matmul(x, w1, one, act_block=act_block, isa=path))
        np.testing.assert_allclose(got, same, rtol=1e-5, atol=1e-6 * np.abs(same).max())


def test_two_level_round_trip_and_dequantize():
    """`unpack` inverts `pack` for (d, c) pairs (a stack too); `scales` and `dequantize` give the float32
    scales and matrix of the one-level layout exactly."""
    rng = np.random.default_rng(4)
    layout = cq.Layout(300, 40, 32, 4, 0, True, 4, superblock=256)
    parts = [two_level_weights(rng, layout) for _ in range(2)]
    u, s, m = (np.stack(a) for a in zip(*parts))
    st, mt = two_level(s, layout), two_level(m, layout)
    w = cq.pack(u, st, mt, layout)
    assert w.shape == (2, *layout.blob_shape) and layout.blob_shape == (3, 2, 16 * 128 + 2 * (64 + 8 * 16))
    u2, s2, m2 = cq.unpack(w, layout)
    np.testing.assert_array_equal(np.asarray(u2), u)
    for got, want in ((s2, st), (m2, mt)):
        assert np.array_equal(got[0], want[0]) and got[1].dtype == jnp.int8 and np.array_equal(got[1], want[1])
    np.testing.assert_array_equal(np.asarray(cq.scales(s2, layout)), s)
    np.testing.assert_array_equal(np.asarray(cq.dequantize(w, layout)),
                                  np.asarray(cq.dequantize(cq.pack(u, s, m, flat(layout)), flat(layout))))


def test_two_level_factorization():
    """d * c is the scales exactly, d a float16 value where the file's was one (the groups' common divisor,
    less an odd factor where that has too many bits); values without such a form (any float, c outside int8,
    NaN) give None."""
    rng = np.random.default_rng(6)
    layout = cq.Layout(512, 16, 32, 4, 0, False, superblock=256)
    _, s, _ = two_level_weights(rng, layout)
    s[8:16, 3] = 0  # a superblock of zeros
    d, c = two_level(s, layout)
    assert d.shape == (2, 16) and c.shape == (16, 16) and c.dtype == np.int8
    np.testing.assert_array_equal(d[np.arange(16) // 8] * c.astype(np.float32), s)
    assert cq.half_exact(d) and not c[8:16, 3].any()
    two = cq.Layout(256, 64, 128, 4, 0, False, superblock=256)  # c pairs: their gcd often odd and over 1
    s2 = two_level_weights(rng, two)[1]
    assert cq.half_exact(two_level(s2, two)[0])
    assert two_level(rng.uniform(1e-3, 1e-2, s.shape).astype(np.float32), layout) is None
    wide = s.copy()
    wide[:8, 0] = np.float32(2.0 ** -10) * np.array([1, 200, 0, 0, 0, 0, 0, 3], np.float32)  # c = 200
    assert two_level(wide, layout) is None
    s[2, 2] = np.nan
    assert two_level(s, layout) is None


def test_two_level_bad_operands_are_named():
    """The layout, `pack`, the wrapper and the handler refuse a two-level operand that does not fit, by name."""
    rng = np.random.default_rng(3)
    layout = cq.Layout(256, 32, 32, 4, 0, True, superblock=256)
    u, s, m, w = packed(rng, layout)
    st, mt = two_level(s, layout), two_level(m, layout)
    x = jnp.zeros((2, 256), jnp.float32)
    bad = [(lambda: cq.Layout(256, 32, 32, 4, superblock=128), "superblock"),
           (lambda: cq.Layout(100, 32, 100, 4, superblock=256), "superblock"),
           (lambda: cq.pack(u, s, mt, layout), "s must be a"),
           (lambda: cq.pack(u, (st[0], st[1].astype(np.uint8)), mt, layout), "s's c must"),
           (lambda: cq.pack(u, st, (mt[0][:, :16], mt[1]), layout), "m's d must"),
           (lambda: cq.pack(u, (st[0] * np.float32(1.0001), st[1]), mt, cq.Layout(256, 32, 32, 4, 0, True, 2, 256)),
            "not float16"),
           (lambda: cq.cpu_quant_matmul(x, w, flat(layout)), "w must be the packed")]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
    call = jax.ffi.ffi_call(cq.TARGET, jax.ShapeDtypeStruct((2, 32), jnp.float32))
    one = lambda v: np.array([v], np.int64)  # noqa: E731 (the format attributes hold one value a matrix)
    attrs = dict(K=np.int64(256), N=one(32), group=one(32), bits=one(4), zero=one(0), has_min=one(1),
                 scale_bytes=one(4), superblock=one(256), act_block=np.int64(32), act_bits=np.int64(8),
                 act_outlier=np.float32(0), isa=np.int64(3))
    np.testing.assert_array_equal(np.asarray(call(x, w, jnp.int32(0), jnp.int32(2), **attrs)), 0)
    for change, match in ((dict(superblock=one(0)), "w must be the packed"),
                          (dict(superblock=one(128)), "superblock must be"),
                          (dict(group=one(256)), "superblock must be"),
                          (dict(group=one(16)), "w must be the packed")):
        with pytest.raises(Exception, match=match):
            np.asarray(call(x, w, jnp.int32(0), jnp.int32(2), **{**attrs, **change}))


def test_fused_call_mixes_the_forms():
    """One call over several matrices (`cpu_quant_matmuls`) takes two-level and one-level ones together,
    each product its own call's, bit for bit."""
    rng = np.random.default_rng(8)
    two = cq.Layout(512, 40, 32, 4, 0, True, 2, superblock=256)
    q6 = cq.Layout(512, 24, 16, 8, 32, False, 4, superblock=256)
    _, _, _, w2 = packed(rng, two)
    _, _, _, w6 = packed(rng, q6)
    one = cq.Layout(512, 16, 32, 4, 8)
    w1 = cq.pack(rng.integers(0, 16, (512, 16), dtype=np.uint8),
                 rng.uniform(1e-3, 1e-2, one.scale_shape).astype(np.float32), None, one)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)
    ys = cq.cpu_quant_matmuls(x, [w2, w1, w6], [two, one, q6])
    for y, w, layout in zip(ys, (w2, w1, w6), (two, one, q6)):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(cq.cpu_quant_matmul(x, w, layout)))
