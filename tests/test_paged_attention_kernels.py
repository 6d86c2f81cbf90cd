"""Pallas paged-attention kernels against the plain-JAX reference (itself checked against dense softmax).

CPU runs the kernels in interpret mode; ``TestKernelsGPU`` runs the same cases natively (marker ``gpu``)
and skips without a GPU.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

ON_GPU = jax.devices()[0].platform == "gpu"
BS = 16
TOL = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# decode: context lengths 1, bs-1, bs, bs+1, several blocks, empty slot
DECODE_LENS = [1, BS - 1, BS, BS + 1, 3 * BS + 5, 0, 5 * BS]
# ragged: (context length, query tokens) per slot: full prefill, decode, empty, chunked prefills
RAGGED = [(BS + 1, BS + 1), (3 * BS + 5, 1), (0, 0), (BS, BS - 1), (2 * BS + 3, 20), (1, 1), (BS - 1, 3)]
PAD_ROWS = 5


def cdiv(a, b):
    return -(-a // b)


def make_case(seed, ctx_lens, *, kv_heads=2, group=2, head_dim=64, block_size=BS, dtype=jnp.float32,
              num_tokens=None, stale=50.0):
    """Random pools, randomly permuted block tables; unused positions hold `stale` * noise."""
    rng = np.random.default_rng(seed)
    need = [cdiv(n, block_size) for n in ctx_lens]
    S, B = len(ctx_lens), max(need) + 1
    N = 1 + sum(need) + 3
    ids = rng.permutation(np.arange(1, N))
    tables = np.zeros((S, B), np.int32)  # padding -> null block 0
    used = np.zeros((N, block_size), bool)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
        flat = np.arange(ctx_lens[i])
        used[tables[i, flat // block_size], flat % block_size] = True
    shape = (N, block_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    k[~used], v[~used] = stale * rng.standard_normal(k[~used].shape), stale * rng.standard_normal(
        v[~used].shape)
    T = S if num_tokens is None else num_tokens
    q = rng.standard_normal((T, kv_heads * group, head_dim))
    cast = lambda x: jnp.asarray(x, dtype)
    return dict(q=cast(q), k_pool=cast(k), v_pool=cast(v), block_tables=jnp.asarray(tables),
                seq_lens=jnp.asarray(ctx_lens, jnp.int32)), used


def ragged_case(seed, slots=RAGGED, pad_rows=PAD_ROWS, **kw):
    qlens = [n for _, n in slots]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    case, used = make_case(seed, [c for c, _ in slots], num_tokens=int(qsl[-1]) + pad_rows, **kw)
    case["query_start_loc"] = jnp.asarray(qsl)
    return case, used


def dense_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, scale=None, window=None,
                    softcap=None):
    """Naive float64 softmax attention, slot by slot, causal (within `window`), from the gathered dense K/V."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    tables, lens, qsl = (np.asarray(x) for x in (block_tables, seq_lens, query_start_loc))
    T, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    out = np.zeros((T, Hq, D))
    for i, L in enumerate(lens):
        rows = np.arange(qsl[i], qsl[i + 1])
        if not len(rows) or not L:  # no query, or nothing to see (zeros)
            continue
        k = np.repeat(k_pool[tables[i]].reshape(-1, Hkv, D)[:L], Hq // Hkv, axis=1)  # [L, Hq, D]
        v = np.repeat(v_pool[tables[i]].reshape(-1, Hkv, D)[:L], Hq // Hkv, axis=1)
        pos = L - (qsl[i + 1] - rows)  # [n]
        s = np.einsum("nhd,lhd->nhl", q[rows], k) * (D ** -0.5 if scale is None else scale)
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        k_pos, q_pos = np.arange(L)[None, None, :], pos[:, None, None]
        s = np.where((k_pos <= q_pos) & (k_pos > q_pos - (window or L + 1)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[rows] = np.einsum("nhl,lhd->nhd", w / w.sum(-1, keepdims=True), v)
    return out


def assert_close(out, expect, dtype):
    assert out.dtype == jnp.dtype(dtype)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(jnp.asarray(expect, jnp.float32)), **TOL[dtype])


_JITTED = {}


def reference(fn, *args):
    """The plain-JAX reference, jitted, at full float32 matmul precision (no TF32 on GPU)."""
    with jax.default_matmul_precision("highest"):
        return _JITTED.setdefault(fn, jax.jit(fn))(*args)


@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128)])
def test_reference_matches_dense_softmax(group, head_dim):
    case, _ = ragged_case(0, group=group, head_dim=head_dim)
    dense = dense_attention(**case)
    np.testing.assert_allclose(reference(ragged_paged_attention_reference, *case.values()), dense,
                               atol=1e-5, rtol=1e-5)
    dec, _ = make_case(1, DECODE_LENS, group=group, head_dim=head_dim)
    qsl = jnp.arange(len(DECODE_LENS) + 1, dtype=jnp.int32)
    np.testing.assert_allclose(reference(paged_attention_reference, *dec.values()),
                               dense_attention(**dec, query_start_loc=qsl), atol=1e-5, rtol=1e-5)


# every (GQA, head_dim), (GQA, dtype) and (head_dim, dtype) pair once; the first four run in the fast set
PAIRWISE = [(1, 64, jnp.float32), (2, 128, jnp.bfloat16), (4, 64, jnp.bfloat16), (8, 128, jnp.float32),
            (1, 128, jnp.bfloat16), (2, 64, jnp.float32), (4, 128, jnp.float32), (8, 64, jnp.bfloat16)]
SHAPES = [pytest.param(g, d, t, id=f"gqa{g}-d{d}-{jnp.dtype(t).name}", marks=() if i < 4 else pytest.mark.slow)
          for i, (g, d, t) in enumerate(PAIRWISE)]


class TestKernels:
    interpret = True

    @pytest.mark.parametrize("group,head_dim,dtype", SHAPES)
    def test_decode(self, group, head_dim, dtype):
        case, _ = make_case(2, DECODE_LENS, group=group, head_dim=head_dim, dtype=dtype)
        out = paged_attention(**case, interpret=self.interpret)
        assert_close(out, reference(paged_attention_reference, *case.values()), dtype)
        assert not np.asarray(out[DECODE_LENS.index(0)].astype(jnp.float32)).any()  # empty slot: zeros

    @pytest.mark.parametrize("group,head_dim,dtype", SHAPES)
    def test_ragged(self, group, head_dim, dtype):
        case, _ = ragged_case(3, group=group, head_dim=head_dim, dtype=dtype)
        out = ragged_paged_attention(**case, interpret=self.interpret)
        assert_close(out, reference(ragged_paged_attention_reference, *case.values()), dtype)
        assert not np.asarray(out[-PAD_ROWS:].astype(jnp.float32)).any()  # padding rows: zeros

    @pytest.mark.parametrize("tuning", [dict(num_splits=1, blocks_per_iter=2), dict(num_splits=3),
                                        dict(num_splits=7, blocks_per_iter=2)], ids=str)
    def test_decode_tuning_and_odd_group(self, tuning):
        case, _ = make_case(4, DECODE_LENS, kv_heads=2, group=3, block_size=8)
        out = paged_attention(**case, interpret=self.interpret, **tuning)
        assert_close(out, reference(paged_attention_reference, *case.values()), jnp.float32)

    @pytest.mark.parametrize("tuning", [dict(block_q=16, blocks_per_iter=2), dict(block_q=32)], ids=str)
    def test_ragged_tuning_and_odd_group(self, tuning):
        case, _ = ragged_case(5, kv_heads=1, group=3, block_size=8)
        out = ragged_paged_attention(**case, interpret=self.interpret, **tuning)
        assert_close(out, reference(ragged_paged_attention_reference, *case.values()), jnp.float32)

    def test_q_dtype_differs_from_pools(self):
        """q is cast to the pools' dtype for the dots; the output keeps q's dtype."""
        case, _ = make_case(13, DECODE_LENS, dtype=jnp.bfloat16)
        case["q"] = case["q"].astype(jnp.float32)
        out = paged_attention(**case, interpret=self.interpret)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), reference(paged_attention_reference, *case.values()),
                                   **TOL[jnp.bfloat16])  # q rounded to bf16
        rcase, _ = ragged_case(14)
        rcase["q"] = rcase["q"].astype(jnp.bfloat16)
        assert_close(ragged_paged_attention(**rcase, interpret=self.interpret),
                     reference(ragged_paged_attention_reference, *rcase.values()), jnp.bfloat16)

    def test_stale_nan_in_pool_is_ignored(self):
        """Positions past a slot's length (and the null block) may hold anything, even NaN."""
        case, used = ragged_case(6)
        clean = reference(ragged_paged_attention_reference, *case.values())
        dirty = dict(case, k_pool=case["k_pool"].at[~used].set(jnp.nan),
                     v_pool=case["v_pool"].at[~used].set(jnp.nan))
        assert_close(ragged_paged_attention(**dirty, interpret=self.interpret), clean, jnp.float32)
        dec, used = make_case(7, DECODE_LENS)
        clean = reference(paged_attention_reference, *dec.values())
        dec.update(k_pool=dec["k_pool"].at[~used].set(jnp.nan), v_pool=dec["v_pool"].at[~used].set(jnp.nan))
        assert_close(paged_attention(**dec, interpret=self.interpret, num_splits=2), clean, jnp.float32)

    @pytest.mark.slow
    def test_long_contexts(self):
        lens = [40 * BS - 3, 17 * BS, 1, 0, 33 * BS + 9]
        case, _ = make_case(8, lens, group=4, head_dim=128, dtype=jnp.bfloat16)
        expect = reference(paged_attention_reference, *case.values())
        for splits in (1, 4):
            assert_close(paged_attention(**case, interpret=self.interpret, num_splits=splits), expect,
                         jnp.bfloat16)
        slots = [(40 * BS - 3, 70), (17 * BS, 1), (0, 0), (33 * BS + 9, 1)]
        rcase, _ = ragged_case(9, slots, group=4, head_dim=128, dtype=jnp.bfloat16)
        assert_close(ragged_paged_attention(**rcase, interpret=self.interpret),
                     reference(ragged_paged_attention_reference, *rcase.values()), jnp.bfloat16)

    def test_jit_scan_over_layers_with_flattened_pool(self):
        """The engine's use: one [L*N, ...] pool, block tables offset per layer, kernels inside lax.scan."""
        case, _ = ragged_case(10)
        L, N = 3, case["k_pool"].shape[0]
        rng = np.random.default_rng(11)
        pools = [jnp.asarray(rng.standard_normal((L * N,) + case["k_pool"].shape[1:]), jnp.float32)
                 for _ in range(2)]
        qs = jnp.asarray(rng.standard_normal((L,) + case["q"].shape), jnp.float32)
        qsl, lens, tables = case["query_start_loc"], case["seq_lens"], case["block_tables"]
        dec_q = qs[:, :len(RAGGED)]

        @jax.jit
        def run(qs, dec_q, k, v, tables, lens, qsl):
            def layer(_, x):
                q, dq, l = x
                t = tables + l * N
                return None, (ragged_paged_attention(q, k, v, t, lens, qsl, interpret=self.interpret),
                              paged_attention(dq, k, v, t, lens, interpret=self.interpret, num_splits=2))
            return jax.lax.scan(layer, None, (qs, dec_q, jnp.arange(L)))[1]

        ragged_out, dec_out = run(qs, dec_q, *pools, tables, lens, qsl)
        for l in range(L):
            k, v = (p[l * N:(l + 1) * N] for p in pools)
            assert_close(ragged_out[l], reference(ragged_paged_attention_reference, qs[l], k, v, tables,
                                                  lens, qsl), jnp.float32)
            assert_close(dec_out[l], reference(paged_attention_reference, dec_q[l], k, v, tables, lens),
                         jnp.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestKernelsGPU(TestKernels):
    """The same cases, compiled by Triton and run natively."""
    interpret = False


def test_validation_errors():
    case, _ = make_case(12, [3, 20])
    bad = [
        (dict(q=case["q"][0]), "q must be"),
        (dict(v_pool=case["v_pool"][:-1]), "k_pool and v_pool"),
        (dict(q=case["q"][:, :3]), "multiple of num_kv_heads"),
        (dict(q=jnp.zeros((2, 4, 32))), "head_dim of q"),
        (dict(v_pool=case["v_pool"].astype(jnp.bfloat16)), "float32, bfloat16 or float16"),
        (dict(q=case["q"].astype(jnp.int32)), "float32, bfloat16 or float16"),
        (dict(block_tables=case["block_tables"].astype(jnp.float32)), "block_tables"),
        (dict(seq_lens=case["seq_lens"][:1]), "seq_lens"),
        (dict(k_pool=jnp.zeros((4, 16, 2, 48)), v_pool=jnp.zeros((4, 16, 2, 48)), q=jnp.zeros((2, 4, 48))),
         "power of two"),
        (dict(k_pool=jnp.zeros((4, 12, 2, 64)), v_pool=jnp.zeros((4, 12, 2, 64))), "block_size"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            paged_attention(**dict(case, **change), interpret=True)
    with pytest.raises(ValueError, match="slots"):
        paged_attention(**dict(case, q=case["q"][:1]), interpret=True)
    with pytest.raises(ValueError, match="unknown tuning"):
        paged_attention(**case, interpret=True, block_h=16)
    with pytest.raises(ValueError, match="blocks_per_iter"):
        paged_attention(**case, interpret=True, blocks_per_iter=3)
    with pytest.raises(ValueError, match="query_start_loc"):
        ragged_paged_attention(**case, query_start_loc=jnp.zeros((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention(**case, query_start_loc=jnp.zeros((3,), jnp.int32), interpret=True, block_q=2)


def lowered_for_cuda(fn, args) -> str:
    """`fn(*args)` lowered for CUDA (any machine); skips the test when this jaxlib cannot cross-compile."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001
        if "triton" in str(e).lower() and "lowering" not in str(e).lower():  # compiler absent here
            pytest.skip(f"this jaxlib cannot cross-compile Triton: {e}")
        raise


def test_lowers_to_triton_for_cuda():
    """Cross-lower for CUDA on any machine: every op in the kernels has a Triton lowering."""
    for name, fn, args in _kernel_lowerings():
        assert "triton" in lowered_for_cuda(fn, args), name


def _kernel_lowerings():
    """(name, fn, abstract args) of both kernels at the benchmark's shapes (bf16) and a float32 odd-GQA shape."""
    b = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    i = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    pool, fpool = b(1000, 16, 8, 128), f(100, 8, 2, 64)
    return [("decode", lambda *a: paged_attention(*a, num_splits=1), (b(64, 32, 128), pool, pool, i(64, 256), i(64))),
            ("decode_split", paged_attention, (b(4, 32, 128), pool, pool, i(4, 256), i(4))),
            ("ragged", ragged_paged_attention, (b(1088, 32, 128), pool, pool, i(66, 256), i(66), i(67))),
            ("ragged_f32", ragged_paged_attention, (f(100, 6, 64), fpool, fpool, i(8, 16), i(8), i(9)))] + [
        # quantized pools (kv_cache_dtype int8 / float8_e4m3fn) with their scales f32[N, bs, Hkv]
        (f"{name}_{dt.__name__}", fn, (q, jax.ShapeDtypeStruct((1000, 16, 8, 128), dt),
                                      jax.ShapeDtypeStruct((1000, 16, 8, 128), dt), f(1000, 16, 8),
                                      f(1000, 16, 8)) + rest)
        for dt in (jnp.int8, jnp.float8_e4m3fn)
        for name, fn, q, rest in (
            ("decode", lambda q, k, v, ks, vs, t, n: paged_attention(q, k, v, t, n, k_scale=ks, v_scale=vs),
             b(64, 32, 128), (i(64, 256), i(64))),
            ("ragged", lambda q, k, v, ks, vs, t, n, c: ragged_paged_attention(
                q, k, v, t, n, c, k_scale=ks, v_scale=vs), b(1088, 32, 128), (i(66, 256), i(66), i(67))))]


def test_triton_compiles_the_kernels(tmp_path, monkeypatch):
    """Without a GPU: compile the kernels' Triton IR to PTX for sm_90 with the `triton` package, when
    installed (not a project dependency: `pip install --target DIR triton`, then PYTHONPATH=DIR)."""
    triton = pytest.importorskip("triton")
    from jax._src.pallas.triton import pallas_call_registration as registration
    from triton.backends.compiler import GPUTarget
    lower, modules = registration.lowering.lower_jaxpr_to_triton_module, []

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    for name, fn, args in _kernel_lowerings():
        modules.clear()
        jax.clear_caches()  # lowerings are cached: make this one run the Triton lowering again
        try:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        except Exception:  # noqa: BLE001 - newer jaxlibs compile during lowering; the IR is captured first
            pass
        assert len(modules) == 1, name
        path = tmp_path / f"{name}.ttir"
        path.write_text(modules[0])
        kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, num_stages=2))
        assert ".entry" in kernel.asm["ptx"], name


def test_bench_smoke(tmp_path):
    from jaxpaged.bench import kernels as bench
    bench.main(["--cpu-smoke", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert not res["errors"] or res["errors"] == ["jax.experimental.pallas.ops.gpu.paged_attention not importable"]
    assert res["decode"] and res["ragged"]
    for rec in res["decode"] + res["ragged"]:
        assert rec["max_abs_err_vs_ref"] < 2e-2 and rec["ours_s"] > 0
    assert "| batch |" in (tmp_path / "results.md").read_text()


def test_bench_smoke_quantized_pool(tmp_path):
    """--kv-dtype: the decode grid over an int8 pool with its scales, bytes counted narrow."""
    from jaxpaged.bench import kernels as bench
    bench.main(["--cpu-smoke", "--kv-dtype", "int8", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert not res["errors"] and res["decode"] and not res["ragged"]
    cfg = res["config"]
    for rec in res["decode"]:
        assert rec["kv_dtype"] == "int8" and rec["max_abs_err_vs_ref"] < 2e-2 and rec["ours_s"] > 0
        tokens = rec["batch"] * rec["context"]
        assert rec["kv_bytes"] == tokens * cfg["num_kv_heads"] * 2 * (cfg["head_dim"] + 4)
