"""The quantized CPU product (pallas_kernels/matmul/cpu_quant.cc) against numpy, on every path this build has.

The reference dequantizes W = s * (u - zero) + m and quantizes x the way the kernel does (per row and block
of act_block k, to int8: scale max|x| / 127, or int16 codes: max|x| / 16319; round half to even), so the
kernel must match it to float32 summation; a second check bounds the activations' own error against the
float product."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernel cannot be built here")
PATHS = [p for p in ("scalar", "avx2", "avx512_vnni") if cq.ISAS[p] <= cq.ISAS.get(cq.isa() or "scalar", 0)]


def weights(rng, layout, lead=()):
    """Codes, scales and minima of the layout; for float16 ones (scale_bytes 2) float16 values, float16
    subnormals among them (the conversion of every path must keep those too)."""
    u = rng.integers(0, 2 ** layout.bits, (*lead, layout.K, layout.N), dtype=np.uint8)
    s = rng.uniform(1e-3, 2e-2, (*lead, *layout.scale_shape)).astype(np.float32)
    m = rng.normal(0, 0.05, s.shape).astype(np.float32) if layout.has_min else None
    if layout.scale_bytes == 2:
        s.reshape(-1)[::7] = rng.uniform(1e-7, 6e-5, s.reshape(-1)[::7].shape)  # some float16 subnormals
        s = s.astype(np.float16).astype(np.float32)
        if m is not None:
            m.reshape(-1)[::5] *= 1e-3  # some float16 subnormals
            m = m.astype(np.float16).astype(np.float32)
    return u, s, m


def dense(u, s, m, layout):  # W [K, N] float64
    idx = np.arange(layout.K) // layout.group_k
    w = s.astype(np.float64)[idx] * (u.astype(np.float64) - layout.zero)
    return w if m is None else w + m.astype(np.float64)[idx]


def int8_activations(x, layout, act_block, act_bits=8):  # what the kernel multiplies: x quantized, dequantized
    K, top = layout.K, np.float32(cq.ACT_BITS[act_bits])
    Ka = -(-layout.groups * layout.group_k // act_block) * act_block
    xp = np.zeros((x.shape[0], Ka), np.float32)
    xp[:, :K] = x
    b = xp.reshape(x.shape[0], -1, act_block)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, top / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * (amax / top)).astype(np.float64).reshape(x.shape[0], Ka)[:, :K]


CASES = [  # M, K, N, group, bits, zero, has_min
    (1, 64, 16, 16, 8, 128, False), (3, 100, 40, 32, 4, 8, False), (5, 256, 48, 64, 8, 0, True),
    (7, 130, 33, 130, 4, 0, True), (64, 512, 64, 128, 4, 8, False), (2, 300, 80, 300, 8, 128, False),
    (17, 96, 16, 16, 4, 0, True), (9, 200, 100, 32, 8, 16, False), (13, 64, 24, 64, 4, 0, False),
]


HALF_CASES = [  # float16 scales and minima (scale_bytes 2)
    (1, 64, 16, 16, 8, 128, False), (3, 100, 40, 32, 4, 0, True), (7, 130, 33, 130, 4, 8, False),
    (9, 200, 100, 32, 8, 0, True), (13, 96, 24, 64, 4, 0, True),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,K,N,group,bits,zero,has_min", CASES)
def test_kernel_equals_reference(M, K, N, group, bits, zero, has_min, path, scale_bytes=4):
    """K not a multiple of the group (and of 16), N tails, row tails of every row block, G 16..128 and per
    column, 8- and 4-bit codes, with and without a minimum, float32 or bfloat16 x, activation blocks of 32
    and 128 (what one scale a column takes: `Layout.act_block`) on every path, int8 and int16 activations (the
    latter's error < 1/50 of int8's bound)."""
    rng = np.random.default_rng(M * K + N + bits)
    layout = cq.Layout(K, N, group, bits, zero, has_min, scale_bytes)
    u, s, m = weights(rng, layout)
    w = cq.pack(u, s, m, layout)
    wd = dense(u, s, m, layout)
    x = jnp.asarray(rng.standard_normal((M, K)), (jnp.float32, jnp.bfloat16)[(M + N) % 2])
    xf = np.asarray(x, np.float32)
    float_product = xf.astype(np.float64) @ wd
    for act_bits, act_block in [(8, 32), (16, 32), (8, 128), (16, 128)]:
        got = np.asarray(cq.cpu_quant_matmul(x, w, layout, act_block=act_block, act_bits=act_bits, isa=path))
        want = int8_activations(xf, layout, act_block, act_bits) @ wd
        assert got.dtype == np.float32 and got.shape == (M, N)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(act_bits))
        bound = 0.02 if act_bits == 8 else 4e-4
        assert np.linalg.norm(got - float_product) <= bound * np.linalg.norm(float_product), act_bits


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,K,N,group,bits,zero,has_min", HALF_CASES)
def test_half_scales_equal_reference(M, K, N, group, bits, zero, has_min, path):
    """The layout with float16 scales and minima (subnormal ones too) against the same reference, on every
    path: the blob is smaller by 2 (or 4) bytes a column a group, the product the same."""
    assert cq.Layout(K, N, group, bits, zero, has_min, 2).group_bytes == \
        cq.Layout(K, N, group, bits, zero, has_min).group_bytes - 32 * (1 + has_min)
    test_kernel_equals_reference(M, K, N, group, bits, zero, has_min, path, scale_bytes=2)


@pytest.mark.parametrize("path", PATHS)
def test_live_rows_only(path):
    """`rows` (traced): the live rows equal the full product's, every row past them is zero (a NaN there is
    never read), on every path and at each row block's edge."""
    import jax
    rng = np.random.default_rng(5)
    layout = cq.Layout(96, 40, 32, 8, 128)
    u, s, _ = weights(rng, layout)
    w = cq.pack(u, s, None, layout)
    x = np.asarray(rng.standard_normal((17, 96)), np.float32)
    full = np.asarray(cq.cpu_quant_matmul(jnp.asarray(x), w, layout, isa=path))
    x[9:] = np.nan  # padding a live-rows product must not touch
    f = jax.jit(lambda x, r: cq.cpu_quant_matmul(x, w, layout, rows=r, isa=path))
    for rows in (0, 1, 4, 7, 9):
        got = np.asarray(f(jnp.asarray(x), jnp.int32(rows)))
        np.testing.assert_array_equal(got[:rows], full[:rows])
        assert not got[rows:].any(), rows


@pytest.mark.parametrize("lead,group,bits,has_min,scale_bytes", [((), 32, 4, True, 4), ((3,), 16, 8, False, 4),
                                                                 ((2,), 100, 4, False, 4), ((2,), 32, 4, True, 2),
                                                                 ((), 100, 8, False, 2)])
def test_pack_round_trip(lead, group, bits, has_min, scale_bytes):
    """`unpack` is `pack`'s exact inverse (one matrix or a stack, float32 or float16 scales); `dequantize` is
    s * (u - zero) + m."""
    rng = np.random.default_rng(len(lead) + group)
    layout = cq.Layout(100, 40, group, bits, 0 if has_min else 2 ** (bits - 1), has_min, scale_bytes)
    u, s, m = weights(rng, layout, lead)
    w = cq.pack(u, s, m, layout)
    assert w.shape == lead + layout.blob_shape and w.dtype == jnp.uint8
    u2, s2, m2 = cq.unpack(w, layout)
    np.testing.assert_array_equal(np.asarray(u2), u)
    np.testing.assert_array_equal(np.asarray(s2), s)
    assert (m2 is None) == (m is None) and (m is None or np.array_equal(np.asarray(m2), m))
    want = np.stack([dense(*a, layout) for a in zip(u.reshape(-1, 100, 40), s.reshape(-1, *s.shape[-2:]),
                                                    [None] * u.size if m is None else m.reshape(-1, *m.shape[-2:]))])
    np.testing.assert_allclose(np.asarray(cq.dequantize(w, layout)).reshape(want.shape), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())


def test_act_block_follows_the_scale_group():
    """A layout's activation block is the largest of 32 / 64 / 128 dividing its scales' k: groups of 16 and 32
    take 32, groups of 64 / 128 their own, one scale a column (K rounded up to 128) 128, the two-level form 32."""
    blocks = {(100, 16, 0): 32, (100, 32, 0): 32, (256, 64, 0): 64, (300, 128, 0): 128, (300, 300, 0): 128,
              (64, 64, 0): 64, (512, 32, 256): 32, (512, 16, 256): 32}
    for (K, group, superblock), want in blocks.items():
        assert cq.Layout(K, 16, group, 4, 8, superblock=superblock).act_block == want, (K, group, superblock)


def test_stacked_layer_and_leading_axes():
    """A stack [L, ...] read at a (traced) layer index, x with leading axes."""
    import jax
    rng = np.random.default_rng(1)
    layout = cq.Layout(96, 48, 32, 4, 8)
    u, s, _ = weights(rng, layout, (3,))
    w = cq.pack(u, s, None, layout)
    x = jnp.asarray(rng.standard_normal((2, 5, 96)), jnp.float32)
    got = jax.jit(lambda x, w, i: cq.cpu_quant_matmul(x, w, layout, layer=i))(x, w, jnp.int32(2))
    want = int8_activations(np.asarray(x).reshape(10, 96), layout, 32) @ dense(u[2], s[2], None, layout)
    assert got.shape == (2, 5, 48)
    np.testing.assert_allclose(np.asarray(got).reshape(10, 48), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_nonfinite_activations_give_nan_rows():
    """A NaN or an infinity in a row of x makes that row's outputs NaN on every path; the others stay exact."""
    rng = np.random.default_rng(2)
    layout = cq.Layout(100, 40, 32, 8, 128)
    w = cq.pack(*weights(rng, layout), layout)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    x[1, 7], x[2, 99] = np.nan, np.inf
    for path in PATHS:
        for act_bits in cq.ACT_BITS:
            y = np.asarray(cq.cpu_quant_matmul(jnp.asarray(x), w, layout, act_bits=act_bits, isa=path))
            assert np.isfinite(y[0]).all() and np.isnan(y[1:]).all(), (path, act_bits)


def test_bad_operands_are_named():
    """The wrapper refuses bad operands with errors naming them; so does the handler when called directly."""
    import jax
    layout = cq.Layout(64, 32, 32, 4, 8)
    rng = np.random.default_rng(3)
    u, s, _ = weights(rng, layout)
    w = cq.pack(u, s, None, layout)
    half = cq.Layout(64, 32, 32, 4, 8, scale_bytes=2)
    x = jnp.zeros((2, 64), jnp.float32)
    bad = [(lambda: cq.Layout(64, 32, 48, 4), "group"), (lambda: cq.Layout(64, 32, 32, 3), "bits"),
           (lambda: cq.Layout(64, 32, 32, 4, 16), "zero"), (lambda: cq.Layout(64, 32, 32, 4, 8, True), "zero"),
           (lambda: cq.pack(u[:32], s, None, layout), "u must"), (lambda: cq.pack(u, s[:1], None, layout), "s must"),
           (lambda: cq.pack(u, s, s, layout), "m must"), (lambda: cq.pack(u | 16, s, None, layout), "codes"),
           (lambda: cq.Layout(64, 32, 32, 4, 8, scale_bytes=3), "scale_bytes"),
           (lambda: cq.pack(u, s + np.float32(1e-6), None, half), "not float16"),
           (lambda: cq.cpu_quant_matmul(x, w, half), "w must be the packed"),
           (lambda: cq.cpu_quant_matmul(x.astype(jnp.int32), w, layout), "x must"),
           (lambda: cq.cpu_quant_matmul(x[:, :32], w, layout), "x must"),
           (lambda: cq.cpu_quant_matmul(x, w[:1], layout), "w must"),
           (lambda: cq.cpu_quant_matmul(x, w.astype(jnp.int8), layout), "w must"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, layer=0), "w must"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, act_block=16), "act_block"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, act_bits=4), "act_bits"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, act_bits=16, act_outlier=-1.0), "act_outlier"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, act_bits=16, act_outlier=float("nan")), "act_outlier"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, act_outlier=1.5), "act_outlier"),
           (lambda: cq.cpu_quant_matmul(x, w, layout, isa="sse"), "isa")]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
    call = jax.ffi.ffi_call(cq.TARGET, jax.ShapeDtypeStruct((2, 32), jnp.float32))
    one = lambda v: np.array([v], np.int64)  # noqa: E731 (the format attributes hold one value a matrix)
    attrs = dict(K=np.int64(64), N=one(32), group=one(32), bits=one(4), zero=one(8), has_min=one(0),
                 scale_bytes=one(4), superblock=one(0), act_block=np.int64(32), act_bits=np.int64(8),
                 act_outlier=np.float32(0), isa=np.int64(3))
    for change, match in ((dict(bits=one(8)), "w must be the packed"), (dict(K=np.int64(96)), "x must be"),
                          (dict(scale_bytes=one(2)), "w must be the packed"),
                          (dict(scale_bytes=one(3)), "scale_bytes must be"),
                          (dict(group=one(48)), "group"), (dict(act_block=np.int64(16)), "act_block"),
                          (dict(act_bits=np.int64(12)), "act_bits"),
                          (dict(act_outlier=np.float32(1.5)), "act_outlier"),
                          (dict(act_bits=np.int64(16), act_outlier=np.float32(np.inf)), "act_outlier"),
                          (dict(zero=one(16)), "zero")):
        with pytest.raises(Exception, match=match):
            np.asarray(call(x, w, jnp.int32(0), jnp.int32(2), **{**attrs, **change}))
    for rows in (-1, 3):  # live rows outside [0, M]
        with pytest.raises(Exception, match="rows must be one int32 in"):
            np.asarray(call(x, w, jnp.int32(0), jnp.int32(rows), **attrs))


def test_avx2_build_equals_reference():
    """The kernel built for AVX2 + FMA (no AVX-512: its activation quantization and its AVX2 and scalar paths
    as a CPU without AVX-512 runs them) against the same reference, in a subprocess (its own build)."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_matmul_quant_cpu as t
        assert t.cq.isa() == "avx2" and t.PATHS == ["scalar", "avx2"], (t.cq.isa(), t.PATHS)
        for case in t.CASES[:6]:
            for path in t.PATHS:
                t.test_kernel_equals_reference(*case, path)
        for case in t.HALF_CASES:
            for path in t.PATHS:
                t.test_half_scales_equal_reference(*case, path)
        t.test_nonfinite_activations_give_nan_rows()
        import test_matmul_quant_two_level as two
        for case in two.CASES:
            for path in t.PATHS:
                two.test_two_level_product_equals_reference(*case, path)
        print("ok")
    """)
    env = {**os.environ, "JAXPAGED_CPU_KERNEL_MARCH": "haswell", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
