"""The C++ kernels built with AddressSanitizer and UndefinedBehaviorSanitizer (-fsanitize=address,undefined,
every report fatal), run in a subprocess that preloads the ASan runtime: valid calls of each kernel and the
mis-sized calls of tests/test_kernel_operands.py report nothing (the handlers refuse the latter before any
read). The attention handler with its operand checks cut out reads out of bounds on those same calls, and
the sanitizer says so: the twin that shows this test can fail."""
import concurrent.futures
import os
import re
import subprocess
import sys
import textwrap

import pytest

from pallas_kernels.argmax import cpu as cpu_argmax
from pallas_kernels.attention import cpu as cpu_attention
from pallas_kernels.ffi import loader
from pallas_kernels.matmul import cpu as cpu_matmul
from pallas_kernels.matmul import cpu_quant

pytestmark = pytest.mark.slow  # five sanitized builds and two processes under ASan: ~1-2 min on 2 cores

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
CHECK_CALL = re.compile(r"^\s*if \(ffi::Error e = check\(.*$", re.MULTILINE)  # the attention handler's checks

# Each kernel's calls: the valid ones must equal their references, the mis-sized ones must fail with an error
# (never a read). Run in the subprocess with the sanitized libraries registered under these targets.
DRIVER = textwrap.dedent("""
    import ctypes, sys
    import jax, jax.numpy as jnp, numpy as np
    libs = dict(arg.split("=", 1) for arg in sys.argv[1:])
    for name, path in libs.items():
        handler = {"attention": "JaxpagedCpuPagedAttention", "matmul": "JaxpagedCpuMatmul",
                   "argmax": "JaxpagedCpuArgmax", "quant": "JaxpagedCpuQuantMatmul"}[name]
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target("asan_" + name, jax.ffi.pycapsule(getattr(lib, handler)), platform="cpu")

    def refused(fn):
        try:
            jax.block_until_ready(fn())
        except Exception as e:  # the handler's InvalidArgument
            return "must be" in str(e)
        return False

    rng = np.random.default_rng(0)
    if "attention" in libs:
        from pallas_kernels.attention.reference import ragged_paged_attention_reference as ref
        S, NB, D = 3, 16, 32
        pool = lambda: jnp.asarray(rng.standard_normal((NB, 8, 2, D)), jnp.float32)
        a = dict(q=jnp.asarray(rng.standard_normal((6, 4, D)), jnp.float32), k=pool(), v=pool(),
                 tables=jnp.asarray(rng.permutation(NB)[:12].reshape(S, 4), jnp.int32),
                 lens=jnp.array([5, 20, 31], jnp.int32), qsl=jnp.array([0, 1, 4, 6], jnp.int32))
        def attn(**change):
            call = jax.ffi.ffi_call("asan_attention", jax.ShapeDtypeStruct((6, 4, D), jnp.float32))
            return call(*{**a, **change}.values(), scale=np.float32(D ** -0.5), window=np.int64(0),
                        softcap=np.float32(0))
        for bs_pool in (a["k"], a["k"].astype(jnp.bfloat16)):
            k, v = bs_pool, a["v"].astype(bs_pool.dtype)
            got = attn(k=k, v=v)
            want = ref(a["q"], k, v, a["tables"], a["lens"], a["qsl"])
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)
        for change in (dict(lens=a["lens"][:1]), dict(qsl=a["qsl"][:2]), dict(v=a["v"][:2]),
                       dict(tables=a["tables"][:, :1].reshape(S, 1)[:1])):
            assert refused(lambda: attn(**change)), change
    if "matmul" in libs:
        x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
        def mm(x, w, layer, n, m=5):
            call = jax.ffi.ffi_call("asan_matmul", jax.ShapeDtypeStruct((m, n), jnp.float32))
            return call(x, w, layer, jnp.int32(min(m, 5)), transpose=np.int64(0), packed=np.int64(0),
                        isa=np.int64(3))
        np.testing.assert_allclose(np.asarray(mm(x, w, jnp.int32(0), 48)),
                                   np.asarray(x, np.float32) @ np.asarray(w, np.float32), rtol=1e-5, atol=1e-3)
        for args in ((x, w[:32], jnp.int32(0), 48), (x, w[None], jnp.int32(1), 48), (x, w, jnp.int32(0), 64),
                     (x, w, jnp.int32(0), 48, 9)):
            assert refused(lambda: mm(*args)), [getattr(t, "shape", t) for t in args]
    if "argmax" in libs:
        x = jnp.asarray(rng.standard_normal((9, 40)), jnp.float32)
        am = lambda x, rows: jax.ffi.ffi_call("asan_argmax", jax.ShapeDtypeStruct((rows,), jnp.int32))(x)
        np.testing.assert_array_equal(np.asarray(am(x, 9)), np.asarray(jnp.argmax(x, -1)))
        assert refused(lambda: am(x, 12))
    if "quant" in libs:
        from pallas_kernels.matmul import cpu_quant as cq
        layout = cq.Layout(100, 40, 32, 4, 0, True)  # K not a multiple of the group, N a partial tile, a minimum
        u = rng.integers(0, 16, (100, 40), dtype=np.uint8)
        s = rng.uniform(1e-3, 2e-2, layout.scale_shape).astype(np.float32)
        m = rng.normal(0, 0.05, s.shape).astype(np.float32)
        w = cq.pack(u, s, m, layout)
        x = jnp.asarray(rng.standard_normal((7, 100)), jnp.float32)
        one = lambda v: np.array([v], np.int64)  # the format attributes: one value a matrix
        attrs = dict(K=np.int64(100), N=one(40), group=one(32), bits=one(4), zero=one(0), has_min=one(1),
                     scale_bytes=one(4), superblock=one(0), act_block=np.int64(32),
                     act_bits=np.int64(16), act_outlier=np.float32(1.5), isa=np.int64(3))  # int16 in outlier blocks
        def qmm(x, w, layer=0, rows=7, m=7, **change):
            call = jax.ffi.ffi_call("asan_quant", jax.ShapeDtypeStruct((m, 40), jnp.float32))
            return call(x, w, jnp.int32(layer), jnp.int32(rows), **{**attrs, **change})
        want = np.asarray(x, np.float64) @ np.asarray(cq.dequantize(w, layout), np.float64)
        for rows in (7, 3):
            got = np.asarray(qmm(x, w, rows=rows))
            err = np.linalg.norm(got[:rows] - want[:rows])
            assert err <= 0.02 * np.linalg.norm(want[:rows]) and not got[rows:].any(), (rows, err)
        half = cq.Layout(100, 40, 32, 4, 0, True, scale_bytes=2)  # float16 scales and minima
        wh = cq.pack(u, s.astype(np.float16).astype(np.float32), m.astype(np.float16).astype(np.float32), half)
        want = np.asarray(x, np.float64) @ np.asarray(cq.dequantize(wh, half), np.float64)
        got = np.asarray(qmm(x, wh, scale_bytes=one(2)))
        assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want)
        # the many-row path: 4-bit codes with int8 activations (a block of 6 rows and a tail), 8-bit ones (7 rows)
        got = np.asarray(qmm(x, wh, scale_bytes=one(2), act_bits=np.int64(8), act_outlier=np.float32(0)))
        assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want)
        l8 = cq.Layout(100, 40, 32, 8, 0, True, 2)
        w8 = cq.pack(rng.integers(0, 256, (100, 40), dtype=np.uint8), s.astype(np.float16).astype(np.float32),
                     m.astype(np.float16).astype(np.float32), l8)
        want8 = np.asarray(x, np.float64) @ np.asarray(cq.dequantize(w8, l8), np.float64)
        got = np.asarray(qmm(x, w8, bits=one(8), scale_bytes=one(2)))
        assert np.linalg.norm(got - want8) <= 0.02 * np.linalg.norm(want8)
        two = cq.Layout(100, 40, 32, 4, 0, True, 2, superblock=256)  # K-quants' form: d per 256 k, int8 c a group
        d = rng.uniform(1e-3, 1e-2, (1, 40)).astype(np.float16).astype(np.float32)
        c = [rng.integers(lo, 64, two.scale_shape).astype(np.int8) for lo in (0, -63)]
        wt = cq.pack(u, (d, c[0]), (d, c[1]), two)
        want = np.asarray(x, np.float64) @ np.asarray(cq.dequantize(wt, two), np.float64)
        got = np.asarray(qmm(x, wt, scale_bytes=one(2), superblock=one(256)))
        assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want)
        # a lone row over 5 tiles (the lone-row 4-bit loop: a unit of 4 tiles, then one), K past a superblock
        u5 = rng.integers(0, 16, (300, 80), dtype=np.uint8)
        x5 = jnp.asarray(rng.standard_normal((7, 300)), jnp.float32)
        for lay in (cq.Layout(300, 80, 32, 4, 0, True, 2, 256), cq.Layout(300, 80, 32, 4, 8, False, 2)):
            d5 = rng.uniform(1e-3, 1e-2, (lay.groups, 80)).astype(np.float16).astype(np.float32)
            c5 = rng.integers(1, 64, (lay.scale_shape[0], 80)).astype(np.int8)
            w5 = cq.pack(u5, (d5, c5), (d5, -c5), lay) if lay.superblock else cq.pack(u5, d5, None, lay)
            call = jax.ffi.ffi_call("asan_quant", jax.ShapeDtypeStruct((7, 80), jnp.float32))
            got = np.asarray(call(x5, w5, jnp.int32(0), jnp.int32(1), **{**attrs, **dict(
                K=np.int64(300), N=one(80), zero=one(lay.zero), has_min=one(int(lay.has_min)), scale_bytes=one(2),
                superblock=one(lay.superblock))}))
            want = np.asarray(x5[:1], np.float64) @ np.asarray(cq.dequantize(w5, lay), np.float64)
            assert np.linalg.norm(got[:1] - want) <= 0.02 * np.linalg.norm(want) and not got[1:].any(), lay
        for args, change in (((x, w[:1]), {}), ((x[:, :64], w), {}), ((x, w[None], 1), {}), ((x, w, 0, 8), {}),
                             ((x, w, 0, 7, 5), {}), ((x, w), dict(bits=one(8))),
                             ((x, w), dict(scale_bytes=one(2))), ((x, wh), {}),
                             ((x, wt), dict(scale_bytes=one(2))), ((x, w), dict(superblock=one(256)))):
            assert refused(lambda: qmm(*args, **change)), ([getattr(t, "shape", t) for t in args], change)
        # several matrices in one call (a per-column int8 one: a longer quantized row than the grouped ones)
        col = cq.Layout(100, 24, 100, 8, 128)
        wc = cq.pack(rng.integers(0, 256, (100, 24), dtype=np.uint8), s[:1, :24], None, col)
        fused = jax.ffi.ffi_call("asan_quant", [jax.ShapeDtypeStruct((7, n), jnp.float32) for n in (40, 24, 40)])
        both = dict(attrs, N=np.array([40, 24, 40]), group=np.array([32, 100, 32]), bits=np.array([4, 8, 4]),
                    zero=np.array([0, 128, 0]), has_min=np.array([1, 0, 1]), scale_bytes=np.array([4, 4, 2]),
                    superblock=np.array([0, 0, 0]))
        ys = fused(x, w, jnp.int32(0), jnp.int32(5), wc, wh, **both)
        alone = jax.ffi.ffi_call("asan_quant", jax.ShapeDtypeStruct((7, 24), jnp.float32))(
            x, wc, jnp.int32(0), jnp.int32(5), **{**attrs, **{k: v[1:2] for k, v in both.items() if np.ndim(v)}})
        for y, y1 in zip(ys, (qmm(x, w, rows=5), alone, qmm(x, wh, rows=5, scale_bytes=one(2)))):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(y1))
        assert refused(lambda: fused(x, w, jnp.int32(0), jnp.int32(5), wh, wc, **both))
    print("driver done")
""")


def _sanitized(source, out, cut_checks=False):
    """`source` compiled with the sanitizers (and the loader's flags, -O0: the quickest build) to `out`; with
    `cut_checks` a copy of it whose handler skips its operand checks."""
    if cut_checks:
        with open(source) as f:
            text, n = CHECK_CALL.subn("", f.read())
        assert n == 1, "the attention handler's check call moved: update CHECK_CALL"
        source = out + ".cc"
        with open(source, "w") as f:
            f.write(text)
    flags = [f for f in loader.compile_flags() if f != "-O3"] + ["-O0", "-I", os.path.dirname(cpu_attention.SOURCE)]
    done = subprocess.run([loader.compiler(), *flags, *SANITIZE, source, "-o", out], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _run(libs):
    runtime = subprocess.run([loader.compiler(), "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    # libstdc++ preloaded too: ASan intercepts __cxa_throw only if it is loaded when ASan starts
    cxx_runtime = subprocess.run([loader.compiler(), "-print-file-name=libstdc++.so"], capture_output=True,
                                 text=True).stdout.strip()
    env = {**os.environ, "LD_PRELOAD": f"{runtime}:{cxx_runtime}", "JAX_PLATFORMS": "cpu",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
    args = [f"{k}={v}" for k, v in libs.items()]
    return subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    try:
        loader.compiler()
    except RuntimeError as e:
        pytest.skip(f"no compiler to build the sanitized kernels: {e}")
    runtime = subprocess.run([loader.compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True)
    if not os.path.isabs(runtime.stdout.strip()):
        pytest.skip("the compiler has no AddressSanitizer runtime (libasan.so)")
    d = tmp_path_factory.mktemp("asan")
    jobs = {"attention": (cpu_attention.SOURCE, False), "matmul": (cpu_matmul.SOURCE, False),
            "argmax": (cpu_argmax.SOURCE, False), "quant": (cpu_quant.SOURCE, False),
            "unchecked": (cpu_attention.SOURCE, True)}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(_sanitized, src, str(d / f"{k}.so"), cut) for k, (src, cut) in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def test_kernels_are_clean_under_the_sanitizers(libraries):
    done = _run({k: libraries[k] for k in ("attention", "matmul", "argmax", "quant")})
    assert "ERROR: AddressSanitizer" not in done.stderr and "runtime error:" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0 and "driver done" in done.stdout, done.stderr[-4000:]


def test_without_its_checks_the_attention_kernel_reads_out_of_bounds(libraries):
    done = _run({"attention": libraries["unchecked"]})
    assert done.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in done.stderr, done.stderr[-4000:]
