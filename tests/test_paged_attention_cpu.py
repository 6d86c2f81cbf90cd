"""The CPU paged attention kernel (pallas_kernels/attention/cpu.cc) against the plain-JAX reference."""
import os
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.step.attention import resolve_backend
from jaxpaged.testing.xla_env import subprocess_env
from pallas_kernels.attention import cpu as cpu_attention
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from pallas_kernels.ffi import loader

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU kernel cannot be built here")
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _case(rng, n_rows, lens, Hkv, G, D, bs, dtype):
    """Random pools, a randomly permuted block table and ragged queries (3 padding rows at the end)."""
    S, B = len(lens), max(-(-max(lens) // bs), 1) + 1
    num_blocks = S * B + 8
    k_pool = jnp.asarray(rng.standard_normal((num_blocks, bs, Hkv, D)), dtype)
    v_pool = jnp.asarray(rng.standard_normal((num_blocks, bs, Hkv, D)), dtype)
    ids = rng.permutation(np.arange(1, num_blocks))[:S * B].reshape(S, B)  # distinct blocks, 0 is the null block
    qsl = np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(qsl[-1]) + 3, G * Hkv, D)), dtype)
    return q, k_pool, v_pool, jnp.asarray(ids, jnp.int32), jnp.asarray(lens, jnp.int32), jnp.asarray(qsl)


def _check(args, dtype, **options):
    got = jax.jit(lambda *a: cpu_attention.cpu_ragged_paged_attention(*a, **options))(*args)
    want = ragged_paged_attention_reference(*args, **options)
    assert got.dtype == want.dtype == args[0].dtype and got.shape == want.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    assert not got[-3:].any()  # padding rows: zeros


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_decode(dtype, G, D):
    bs = 16
    lens = [1, bs - 1, bs, bs + 1, 300, 0]  # 0: an empty slot (no rows)
    rng = np.random.default_rng(G * D)
    n_rows = [1, 1, 1, 1, 1, 0]
    _check(_case(rng, n_rows, lens, 2, G, D, bs, dtype), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("Hkv", [1, 2, 3, 8])
def test_lone_decode_split_over_kv_heads(dtype, Hkv):
    """A lone decode (fewer row tiles than threads) runs as units of KV-head ranges, one a thread (3 heads on
    2 threads: 1 + 2); each head's sums are those it has in a batch, where a unit spans every head: the lone
    slot's output equals the reference and, bit for bit, the same slot's output beside 7 others."""
    rng = np.random.default_rng(Hkv)
    lens = [300, 17, 40, 1, 90, 16, 33, 200]
    q, k_pool, v_pool, ids, seq_lens, qsl = _case(rng, [1] * 8, lens, Hkv, 3, 64, 16, dtype)
    attend = jax.jit(lambda *a: cpu_attention.cpu_ragged_paged_attention(*a, window=250))
    batch = np.asarray(attend(q, k_pool, v_pool, ids, seq_lens, qsl), np.float32)
    lone = (q[:1], k_pool, v_pool, ids[:1], seq_lens[:1], qsl[:2])
    got = np.asarray(attend(*lone), np.float32)
    want = np.asarray(ragged_paged_attention_reference(*lone, window=250), np.float32)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(got[0], batch[0])


@pytest.mark.parametrize("bs", [16, 256])  # the vector path and the plain loops
def test_no_rows_at_all(bs):
    """A call whose slots have no query rows (every row padding): no work unit, the output all zeros."""
    q, k_pool, v_pool, ids, seq_lens, _ = _case(np.random.default_rng(bs), [0, 0], [5, 40], 2, 2, 64, bs,
                                                jnp.bfloat16)
    out = jax.jit(cpu_attention.cpu_ragged_paged_attention)(q, k_pool, v_pool, ids, seq_lens,
                                                             jnp.zeros(3, jnp.int32))
    assert out.shape == q.shape and not np.asarray(out, np.float32).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D,bs", [(40, 8), (16, 32), (96, 16), (24, 4), (32, 256)])
def test_shapes(dtype, D, bs):
    """Head sizes that are not whole 16-lane vectors and block sizes other than 16 (masked tails); blocks
    over cpu.VECTOR_BLOCK_SIZE (256) run the plain-loop `attend()` of every build."""
    rng = np.random.default_rng(D + bs)
    lens = [1, bs, 3 * bs + 1, 70, 9]
    n_rows = [1, 1, 1, 11, 9]
    _check(_case(rng, n_rows, lens, 3, 2, D, bs, dtype), dtype, window=25)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bs", [32, 64])
def test_contexts_off_the_key_tile(dtype, bs):
    """Contexts that are not whole 16-key tiles (the vector path sums 16 keys' dots at once, cpu.cc
    `logits_group`) in blocks of 2 and 4 tiles: 1, 15, 17, 33 keys, a partial last block after whole ones,
    decodes and a 5-row chunk."""
    rng = np.random.default_rng(bs)
    lens = [1, 15, 17, 33, 47, 2 * bs + 17, 3 * bs + 1]
    n_rows = [1, 1, 1, 1, 5, 1, 1]
    _check(_case(rng, n_rows, lens, 3, 3, 64, bs, dtype), dtype)


@pytest.mark.parametrize("D", [64, 40])
def test_float32_queries_on_a_bfloat16_pool(D):
    """float32 queries that are not bfloat16 values over a bfloat16 pool: the logits use all of each query (on
    AVX-512 BF16 split into a bfloat16 hi and lo, cpu_dpbf16.h), to float32's tolerance, not bfloat16's."""
    rng = np.random.default_rng(D)
    q, k_pool, v_pool, *rest = _case(rng, [1, 1, 1, 6], [5, 17, 300, 70], 3, 3, D, 16, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal(q.shape), jnp.float32) * 3  # logits of a few units: a rounded q shows
    args = (q, k_pool, v_pool, *rest)
    got = np.asarray(jax.jit(cpu_attention.cpu_ragged_paged_attention)(*args))
    want = np.asarray(ragged_paged_attention_reference(*args))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


OPTIONS = [{}, {"window": 20}, {"softcap": 3.0}, {"window": 33, "softcap": 10.0, "scale": 0.2}]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("options", OPTIONS)
def test_mixed(dtype, options):
    rng = np.random.default_rng(len(options))
    lens = [1, 15, 16, 17, 40, 200, 9]
    n_rows = [1, 15, 1, 17, 13, 1, 9]  # whole prompts, chunks and decodes
    _check(_case(rng, n_rows, lens, 2, 4, 64, 16, dtype), dtype, **options)


def test_quantized_pools_equal_attention_over_their_dequantized_values():
    """int8 pools with scales (taken by the reference) against an independent computation: the pools
    dequantized in numpy (values x scales) and attended in float32 by the C++ kernel."""
    rng = np.random.default_rng(1)
    q, k_pool, v_pool, tables, lens, qsl = _case(rng, [1, 4], [5, 20], 2, 2, 64, 8, jnp.float32)
    k8, v8 = (np.clip(np.round(np.asarray(p) * 20), -127, 127).astype(np.int8) for p in (k_pool, v_pool))
    k_scale, v_scale = (rng.uniform(0.02, 0.08, k_pool.shape[:3]).astype(np.float32) for _ in range(2))
    got = cpu_attention.cpu_ragged_paged_attention(q, jnp.asarray(k8), jnp.asarray(v8), tables, lens, qsl,
                                                   k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
    k_deq, v_deq = (jnp.asarray(p.astype(np.float32) * s[..., None]) for p, s in ((k8, k_scale), (v8, v_scale)))
    want = cpu_attention.cpu_ragged_paged_attention(q, k_deq, v_deq, tables, lens, qsl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.abs(np.asarray(want)).max() > 0.1  # not a comparison of zeros


@pytest.mark.parametrize("bs", [16, 256])  # the vector path and the plain loops
def test_stale_nan_and_inf_in_the_pool_are_never_read(bs):
    """Pool positions past a slot's length, unused blocks and the null block may hold anything (NaN, inf):
    the output equals that of a clean pool."""
    rng = np.random.default_rng(bs)
    args = list(_case(rng, [1, 4, 1], [5, 20, 2 * bs + 3], 2, 2, 32, bs, jnp.float32))
    k, v = np.asarray(args[1]).copy(), np.asarray(args[2]).copy()
    used = np.zeros(k.shape[:2], bool)  # [num_blocks, bs]
    for row, n in zip(np.asarray(args[3]), np.asarray(args[4])):
        for j in range(n):
            used[row[j // bs], j % bs] = True
    for pool, junk in ((k, np.nan), (v, np.inf)):
        pool[~used] = junk
    clean = cpu_attention.cpu_ragged_paged_attention(*args)
    dirty = cpu_attention.cpu_ragged_paged_attention(args[0], jnp.asarray(k), jnp.asarray(v), *args[3:])
    assert np.isfinite(np.asarray(dirty)).all()
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_resolve():
    assert resolve_backend("auto", 64, 16) == ("cpu" if cpu_attention.vectorized() else "reference")
    assert resolve_backend("reference", 64, 16) == "reference"
    assert resolve_backend("cpu", 64, 16) == "cpu"


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_engine_tokens_equal_the_reference(tiny_models, engine_kwargs):
    """Greedy float32 tokens through chunked prefill (prompts longer than a step's 64 tokens) and prefix hits
    (the same prompts twice) are the reference backend's."""
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, size=n)]} for n in (5, 90, 17, 130)]
    kw = {**engine_kwargs, "enable_prefix_caching": True}
    tokens = {}
    for backend in ("reference", "cpu"):
        llm = LLM(model=tiny_models["llama"], **kw, attention_backend=backend)
        assert llm.engine.runner.backend == backend
        tokens[backend] = [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                           for _ in range(2)]
        del llm
    assert tokens["cpu"] == tokens["reference"]


def test_tensor_parallel_two_devices():
    """TP=2 on two simulated CPU devices: each device runs the kernel on its heads (shard_heads)."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh
        from jaxpaged.step.mesh import MODEL_AXIS
        from jaxpaged.step.attention import make_attention
        from pallas_kernels.attention.reference import ragged_paged_attention_reference as ref
        mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", MODEL_AXIS))
        rng = np.random.default_rng(0)
        k, v = (jnp.asarray(rng.standard_normal((32, 8, 4, 64)), jnp.float32) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((12, 8, 64)), jnp.float32)
        tables = jnp.asarray(rng.permutation(32)[:12].reshape(3, 4), jnp.int32)
        args = (q, k, v, tables, jnp.array([3, 30, 9], jnp.int32), jnp.array([0, 1, 2, 11], jnp.int32))
        got = jax.jit(make_attention("cpu", False, mesh))(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref(*args)), atol=2e-5, rtol=2e-5)
        print("ok")
    """)
    env = {**subprocess_env(2), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_native_build_has_the_widest_vector_path():
    """-march=native on a CPU with AVX-512 F, BW and VL builds the 16-lane path (which every other test of this
    module then runs), with AVX-512 BF16 too its bfloat16-pool logits by vdpbf16ps; with AVX2 + FMA only, the
    8-lane one."""
    flags = set(loader.cpu_flags().split())
    assert cpu_attention.bf16_dots() == ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags)
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert cpu_attention.vector_lanes() == 16
    elif {"avx2", "fma"} <= flags:
        assert cpu_attention.vector_lanes() == 8
    else:
        pytest.skip(f"this CPU has neither AVX-512 nor AVX2 + FMA: the native build has no vector path "
                    f"(vector_lanes {cpu_attention.vector_lanes()})")


ISA_CHECK = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from pallas_kernels.attention import cpu as cpu_attention
    from pallas_kernels.attention.reference import ragged_paged_attention_reference as ref
    assert cpu_attention.vector_lanes() == int(sys.argv[1]), cpu_attention.vector_lanes()
    assert not cpu_attention.bf16_dots()
    rng = np.random.default_rng(0)
    cases = ((jnp.float32, 2e-5, 64, 16), (jnp.bfloat16, 2e-2, 40, 8), (jnp.float32, 2e-5, 20, 32))
    for dtype, tol, D, bs in cases:
        k, v = (np.asarray(rng.standard_normal((40, bs, 2, D)), np.float32) for _ in range(2))
        k[0], v[0] = np.nan, np.inf  # the null block (never in a used table entry) holds junk
        k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        q = jnp.asarray(rng.standard_normal((15, 6, D)), dtype)
        tables = jnp.asarray(rng.permutation(np.arange(1, 40))[:36].reshape(4, 9), jnp.int32)
        args = (q, k, v, tables, jnp.array([3, 70, 9, 1], jnp.int32), jnp.array([0, 1, 2, 11, 12], jnp.int32))
        for opts in ({}, {"window": 21, "softcap": 5.0}):
            got = jax.jit(lambda *a: cpu_attention.cpu_ragged_paged_attention(*a, **opts))(*args)
            want = ref(*args, **opts)
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    print("ok")
""")


@pytest.mark.parametrize("march,lanes", [("skylake-avx512", 16), ("haswell", 8), ("x86-64", 0)])
def test_isa_build_equals_the_reference(march, lanes):
    """The kernel built for another ISA in a subprocess (its own build and registration) against the
    reference: skylake-avx512, AVX-512 without BF16 (16 lanes, a bfloat16 pool's rows widened for the logits);
    haswell, AVX2 + FMA (the 8-lane vector path of CPUs without AVX-512); x86-64, SSE2 only (the plain-loop
    `attend()` of CPUs without AVX2). The native build (AVX-512 + BF16 here) is every other test's."""
    if platform.machine() != "x86_64":
        pytest.skip(f"-march={march} builds for x86-64; this machine is {platform.machine()}")
    if lanes == 16 and not {"avx512f", "avx512bw", "avx512vl"} <= set(loader.cpu_flags().split()):
        pytest.skip(f"-march={march} needs AVX-512 F, BW and VL to run; this CPU has not all of them")
    env = {**os.environ, "JAXPAGED_CPU_KERNEL_MARCH": march, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", ISA_CHECK, str(lanes)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_bench_cpu_attention_smoke(tmp_path):
    """`jaxpaged bench cpu_attention` runs and reports both pools (its figures are not asserted)."""
    import json

    from jaxpaged.bench import cpu_attention
    out = tmp_path / "cpu_attention.json"
    assert cpu_attention.main(["--slots", "4", "--context", "10", "40", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["bfloat16", "float32"]
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 and r["max_abs_diff"] < 0.05 for r in rows)
