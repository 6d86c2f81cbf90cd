"""The CPU matmul kernel (pallas_kernels/matmul/cpu.cc) against numpy, and through the engine against XLA's dot.

Every path the machine can run (AMX, AVX-512 BF16, AVX2 + FMA, scalar) is forced by the `isa` cap and checked
alone; a path this CPU cannot run is skipped with the reason. The default calls run the build's best path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.quant import dot
from jaxpaged.step.matmul import AUTO_ISAS, matmul_name, resolve_matmul
from pallas_kernels.ffi import loader
from pallas_kernels.matmul import cpu as cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel cannot be built here")


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 32, 16), (5, 64, 48), (16, 96, 32), (37, 64, 80), (64, 128, 272),
                                   (9, 576, 1536), (3, 1536, 576)])
def test_kernel_equals_numpy(M, K, N, transpose):
    """Whole and partial row tiles, odd counts of 16-column tiles, one or several K tiles; the model's K = 576
    and 1536 (18 and 48 K tiles: the AMX path's prefetch, taken past 6 tiles) over several 128-column
    panels."""
    rng = np.random.default_rng(M * K + N)
    x, w = _bf16(rng, (M, K)), _bf16(rng, (N, K) if transpose else (K, N))
    wf = np.asarray(w, np.float32)
    want = np.asarray(x, np.float32) @ (wf.T if transpose else wf)
    got = jax.jit(lambda x, w: cpu_matmul.cpu_matmul(x, w, transpose))(x, w)
    assert got.dtype == jnp.float32 and got.shape == (M, N)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4 * np.sqrt(K))


@pytest.mark.parametrize("L,M,K,N", [(None, 1, 32, 16), (None, 37, 64, 80), (3, 64, 128, 272), (2, 5, 96, 48)])
def test_packed_equals_numpy(L, M, K, N):
    """Weights packed once into the tile order (`pack`; `unpack` inverts it exactly), one matrix or a stack
    read at a layer index, through the kernel and through `quant.dot` (a `Packed` leaf, in a `LayerOf`)."""
    from jaxpaged.models.quant import LayerOf, Packed
    rng = np.random.default_rng(M + K + N)
    x, w = _bf16(rng, (M, K)), _bf16(rng, (K, N) if L is None else (L, K, N))
    tiles = cpu_matmul.pack(w)
    assert tiles.shape == w.shape[:-2] + (N // 16, K // 32, 16, 32)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(tiles)), np.asarray(w))
    layer = None if L is None else jnp.int32(L - 1)
    want = np.asarray(x, np.float32) @ np.asarray(w if L is None else w[L - 1], np.float32)
    got = jax.jit(lambda x, t: cpu_matmul.cpu_matmul(x, t, layer=layer, packed=True))(x, tiles)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4 * np.sqrt(K))
    packed = Packed(tiles)
    assert packed.shape == w.shape and packed.dtype == w.dtype
    operand = packed if L is None else LayerOf(packed, layer)
    for kernel in (True, False):  # without the kernel: the matrix unpacked, XLA's dot
        got = dot(x, operand, jnp.float32, kernel=kernel)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-2, atol=1e-2 * np.sqrt(K))


def _run_path_or_skip(isa):
    """Skip (saying why) where this build cannot run path `isa`."""
    best = cpu_matmul.isa()
    if cpu_matmul.ISAS[isa] > cpu_matmul.ISAS[best]:
        pytest.skip(f"the {isa} path untested: the best path here is {best} (this CPU's flags)")


def _want(x, w, transpose):
    wf = np.asarray(w, np.float32)
    return np.asarray(x, np.float32) @ (wf.T if transpose else wf)


@pytest.mark.parametrize("isa", list(cpu_matmul.ISAS))
def test_every_path_equals_numpy(isa):
    """Path `isa` forced by the cap: every row count 1..17 (the row blocks of 8 / 4 / 1, AMX's 16-row tiles,
    their tails), K over 3 and 18 K tiles, N over 17 and 10 column tiles (a partial 128-column panel; the
    transposed form's last unit of 16 rows), w as stored, packed, transposed, and stacked at a layer."""
    _run_path_or_skip(isa)
    assert cpu_matmul.path(576, 160, isa) == isa
    rng = np.random.default_rng(cpu_matmul.ISAS[isa])
    for M in range(1, 18):
        K, N = (96, 272) if M % 2 else (576, 160)
        x = _bf16(rng, (M, K))
        for transpose in (False, True):
            w = _bf16(rng, (3, N, K) if transpose else (3, K, N))
            tol = dict(rtol=1e-5, atol=1e-4 * np.sqrt(K), err_msg=f"M={M} K={K} N={N} transpose={transpose}")
            np.testing.assert_allclose(np.asarray(cpu_matmul.cpu_matmul(x, w[0], transpose, isa=isa)),
                                       _want(x, w[0], transpose), **tol)
            got = cpu_matmul.cpu_matmul(x, w, transpose, layer=jnp.int32(2), isa=isa)
            np.testing.assert_allclose(np.asarray(got), _want(x, w[2], transpose), **tol)
            if not transpose:
                got = cpu_matmul.cpu_matmul(x, cpu_matmul.pack(w), layer=jnp.int32(1), packed=True, isa=isa)
                np.testing.assert_allclose(np.asarray(got), _want(x, w[1], False), **tol)


@pytest.mark.parametrize("isa", list(cpu_matmul.ISAS))
def test_every_path_live_rows_only(isa):
    """`rows` (traced): the live rows equal the full product's, every row past them is zero (NaN padding is
    never read), as stored, transposed and packed."""
    _run_path_or_skip(isa)
    rng = np.random.default_rng(11)
    x = np.asarray(_bf16(rng, (17, 64)), np.float32)
    xs = jnp.asarray(np.where(np.arange(17)[:, None] < 9, x, np.nan), jnp.bfloat16)  # rows 9.. are NaN padding
    for w, kw in ((_bf16(rng, (64, 48)), {}), (_bf16(rng, (48, 64)), dict(transpose=True)),
                  (cpu_matmul.pack(_bf16(rng, (64, 48))), dict(packed=True))):
        full = np.asarray(cpu_matmul.cpu_matmul(jnp.asarray(x, jnp.bfloat16), w, isa=isa, **kw))
        f = jax.jit(lambda x, r: cpu_matmul.cpu_matmul(x, w, isa=isa, rows=r, **kw))
        for rows in (0, 1, 8, 9):
            got = np.asarray(f(xs, jnp.int32(rows)))
            np.testing.assert_array_equal(got[:rows], full[:rows], err_msg=f"{kw} rows={rows}")
            assert not got[rows:].any(), (kw, rows)


@pytest.mark.parametrize("isa", list(cpu_matmul.ISAS))
def test_every_path_several_matrices_in_one_call(isa):
    """`cpu_matmuls`: the products of one x with several matrices (a layer's q, k, v: widths over one partial
    and several whole panels) in one call equal each product alone bit for bit, stacked at a layer, packed,
    as stored and transposed, with live rows; `quant.dots` takes one call for a layer's packed matrices."""
    from jaxpaged.models.quant import LayerOf, Packed, dots
    _run_path_or_skip(isa)
    rng = np.random.default_rng(13)
    K, widths = 96, (272, 48, 16)
    for M in (1, 37):
        x = _bf16(rng, (M, K))
        ws = [_bf16(rng, (2, K, n)) for n in widths]
        for form, mats, kw in (("packed", [cpu_matmul.pack(w) for w in ws], dict(packed=True)), ("stored", ws, {}),
                               ("transposed", [w.swapaxes(1, 2) for w in ws], dict(transpose=True))):
            f = jax.jit(lambda x, r, *m: cpu_matmul.cpu_matmuls(x, m, layer=jnp.int32(1), isa=isa, rows=r, **kw))
            live = jnp.int32(max(M - 1, 1))
            got = f(x, live, *mats)
            assert [g.shape for g in got] == [(M, n) for n in widths]
            for g, m in zip(got, mats):
                alone = cpu_matmul.cpu_matmul(x, m, layer=jnp.int32(1), isa=isa, rows=live, **kw)
                np.testing.assert_array_equal(np.asarray(g), np.asarray(alone), err_msg=f"{form} M={M}")
    index = jnp.int32(1)  # one layer index (the layer loop's) for every matrix
    layer = [LayerOf(Packed(cpu_matmul.pack(w)), index) for w in ws]
    jaxpr = str(jax.make_jaxpr(lambda x: dots(x, layer, jnp.float32, kernel=True))(x))
    assert jaxpr.count("ffi_call") == 1, jaxpr
    for g, w in zip(dots(x, layer, jnp.float32, kernel=True), ws):
        np.testing.assert_allclose(np.asarray(g), _want(x, w[1], False), rtol=1e-5, atol=1e-4 * np.sqrt(K))
    with pytest.raises(ValueError, match="got x .*, w "):  # a matrix of another K than x's
        cpu_matmul.cpu_matmuls(x, [ws[0][1], _bf16(rng, (64, 16))])


@pytest.mark.parametrize("isa", list(cpu_matmul.ISAS))
def test_every_path_propagates_nan(isa):
    """A NaN in a row of x makes that row's outputs NaN, a NaN in w (or an infinity times 0) the outputs of
    its column (its row when transposed) in every row; the rest equal numpy's."""
    _run_path_or_skip(isa)
    rng = np.random.default_rng(7)
    M, K, N = 11, 96, 80
    x = np.asarray(_bf16(rng, (M, K)), np.float32)
    w = np.asarray(_bf16(rng, (K, N)), np.float32)
    x[3, 40], w[70, 17] = np.nan, np.nan
    x[5, 2], w[2, :] = np.inf, 0.0  # inf * 0: row 5 is NaN
    with np.errstate(invalid="ignore"):
        want = x @ w
    assert np.isnan(want[3]).all() and np.isnan(want[:, 17]).all() and np.isnan(want[5]).all()
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    for got in (cpu_matmul.cpu_matmul(xb, wb, isa=isa), cpu_matmul.cpu_matmul(xb, cpu_matmul.pack(wb), packed=True,
                                                                             isa=isa),
                cpu_matmul.cpu_matmul(xb, wb.T, transpose=True, isa=isa)):
        np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(want))
        finite = ~np.isnan(want)
        np.testing.assert_allclose(np.asarray(got)[finite], want[finite], rtol=1e-5, atol=1e-3)


def test_paths_follow_the_cpu_and_the_cap():
    """The native build runs the best path the CPU's flags allow; the cap lowers it, never raises it; shapes
    the tiles do not fit run the scalar loops."""
    flags = set(loader.cpu_flags().split())
    best = ("amx" if {"amx_bf16", "amx_tile"} <= flags and cpu_matmul.amx() else
            "avx512_bf16" if {"avx512_bf16", "avx512bw"} <= flags else
            "avx2" if {"avx2", "fma"} <= flags else "scalar")
    assert cpu_matmul.isa() == best
    for isa in cpu_matmul.ISAS:
        want = min(cpu_matmul.ISAS[isa], cpu_matmul.ISAS[best])
        assert cpu_matmul.ISAS[cpu_matmul.path(64, 32, isa)] == want
    assert cpu_matmul.path(64, 32) == best and cpu_matmul.path(40, 32) == cpu_matmul.path(64, 24) == "scalar"
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_matmul.cpu_matmul(_bf16(np.random.default_rng(0), (1, 32)), _bf16(np.random.default_rng(1), (32, 16)),
                              isa="sse")


def test_amx_path_runs_here():
    """Where the CPU has AMX (amx_bf16, and Linux grants the tiles) the native build multiplies on the tiles,
    and every product test of this module runs that path; elsewhere it is skipped, saying the path that ran."""
    flags = set(loader.cpu_flags().split())
    if "amx_bf16" not in flags or "amx_tile" not in flags:
        pytest.skip(f"AMX untested: this CPU has no amx_bf16 / amx_tile (the products ran the {cpu_matmul.isa()} path)")
    assert cpu_matmul.amx(), "the CPU has AMX but the kernel does not use it (no tile permission from Linux?)"


def test_leading_axes_and_dot():
    """x [..., K]: leading axes are kept; `quant.dot(kernel=True)` rounds to the asked type, and takes XLA's
    dot for shapes the kernel does not (K % 32, float32 operands)."""
    rng = np.random.default_rng(0)
    x, w = _bf16(rng, (2, 3, 64)), _bf16(rng, (64, 32))
    want = np.asarray(jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32))
    got = dot(x, w, kernel=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 3, 32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    odd = _bf16(rng, (3, 40)), _bf16(rng, (40, 32))
    assert not cpu_matmul.supported(*odd) and not cpu_matmul.supported(x.astype(jnp.float32), w)
    np.testing.assert_array_equal(np.asarray(dot(*odd, kernel=True)), np.asarray(dot(*odd)))
    with pytest.raises(ValueError, match="K % 32"):
        cpu_matmul.cpu_matmul(*odd)


def test_resolve():
    assert resolve_matmul("xla", jnp.bfloat16, "cpu", 1) is False
    assert resolve_matmul("auto", jnp.bfloat16, "cpu", 1) is (cpu_matmul.isa() in AUTO_ISAS)
    assert "scalar" not in AUTO_ISAS  # the scalar loops are slower than XLA's dot
    assert matmul_name(True, False) == f"cpu ({cpu_matmul.isa()})" and matmul_name(False, False) == "xla"
    assert resolve_matmul("auto", jnp.float32, "cpu", 1) is False
    assert resolve_matmul("auto", jnp.bfloat16, "cpu", 2) is False
    assert resolve_matmul("auto", jnp.bfloat16, "gpu", 1) is False
    assert resolve_matmul("cpu", jnp.bfloat16, "cpu", 1) is True
    for args, match in (((jnp.float32, "cpu", 1), "dtype 'bfloat16'"), ((jnp.bfloat16, "cpu", 2), "one device"),
                        ((jnp.bfloat16, "tpu", 1), "CPU targets")):
        with pytest.raises(ValueError, match=match):
            resolve_matmul("cpu", *args)
    with pytest.raises(ValueError, match="matmul_backend must be one of"):
        LLM(model="unused", matmul_backend="onednn")


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("tie", [False, True])
def test_engine_tokens_equal_xla(tmp_path, engine_kwargs, tie):
    """bfloat16 greedy tokens through chunked prefill (prompts longer than a step's 64 tokens), decodes and
    prefix hits (the same prompts twice) equal those of XLA's dot; tied: the lm_head is the embedding read
    transposed."""
    from jaxpaged.testing.tiny_models import make_tiny_model
    model = make_tiny_model(str(tmp_path / "m"), "llama", tie=tie, seed=5)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, size=n)]} for n in (5, 90, 17, 130)]
    kw = {**engine_kwargs, "dtype": "bfloat16", "enable_prefix_caching": True}
    tokens = {}
    for backend in ("xla", "cpu"):
        llm = LLM(model=model, **kw, matmul_backend=backend)
        assert llm.engine.runner.step_cfg.cpu_matmul is (backend == "cpu")
        tokens[backend] = [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                           for _ in range(2)]
        del llm
    assert tokens["cpu"] == tokens["xla"]


def test_packed_weights_get_and_update(tmp_path, engine_kwargs):
    """With the kernel the runner keeps its layer matrices packed: `get_weights` still gives them as the model
    lays them out, and `update_weights` (whole tensors, one layer of a stack, HF names) takes plain matrices,
    packs them again and changes the tokens as the same update does on XLA's dot, without recompiling."""
    from jaxpaged.models.quant import Packed
    from jaxpaged.testing.tiny_models import make_tiny_model
    model = make_tiny_model(str(tmp_path / "m"), "llama", seed=7)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 9, 11]}]
    out = {}
    for backend in ("xla", "cpu"):
        llm = LLM(model=model, **{**engine_kwargs, "dtype": "bfloat16", "warmup": True}, matmul_backend=backend)
        eng = llm.engine
        packed = isinstance(eng.runner.params["layers"]["w_up"], Packed)
        assert packed is (backend == "cpu")
        weights = eng.get_weights()
        assert not any(isinstance(a, Packed) for a in jax.tree.leaves(weights, is_leaf=lambda a: isinstance(a, Packed)))
        up = np.asarray(weights["layers"]["w_up"], np.float32)
        before = eng.runner.num_compilations
        new_up = (up + 0.05 * np.random.default_rng(0).standard_normal(up.shape)).astype(jnp.bfloat16)
        adopted = jnp.asarray(new_up)
        eng.update_weights({"layers": {"w_up": adopted}})
        assert not adopted.is_deleted()  # the caller's array is packed, not consumed
        one = np.asarray(eng.get_weights()["layers"]["wo"])[1] * 1.5
        eng.update_weights([("model.layers.1.self_attn.o_proj.weight", one.T.astype(one.dtype))])
        np.testing.assert_array_equal(np.asarray(eng.get_weights()["layers"]["w_up"]), np.asarray(new_up))
        np.testing.assert_array_equal(np.asarray(eng.get_weights()["layers"]["wo"])[1], one)
        assert isinstance(eng.runner.params["layers"]["wo"], Packed) is packed
        out[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert eng.runner.num_compilations == before
        del llm, eng
    assert out["cpu"] == out["xla"]


def test_plain_loop_path():
    """The kernel built for AVX2 (-march=haswell: no AMX, no AVX-512, so its best path is AVX2 + FMA and the
    unpacked weights are interleaved without AVX-512 permutes) against numpy, in a subprocess (its own build
    and registration)."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from pallas_kernels.matmul import cpu as cpu_matmul
        assert cpu_matmul.available() and not cpu_matmul.amx() and cpu_matmul.isa() == "avx2"
        assert cpu_matmul.path(64, 48, "avx512_bf16") == "avx2"
        rng = np.random.default_rng(0)
        for t, K in ((False, 64), (True, 64), (False, 576)):
            x = jnp.asarray(rng.standard_normal((7, K)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((48, K) if t else (K, 48)), jnp.bfloat16)
            wf = np.asarray(w, np.float32)
            want = np.asarray(x, np.float32) @ (wf.T if t else wf)
            np.testing.assert_allclose(np.asarray(cpu_matmul.cpu_matmul(x, w, t)), want, rtol=1e-5, atol=1e-2)
            if not t:  # packed weights: the same contract
                got = cpu_matmul.cpu_matmul(x, cpu_matmul.pack(w), packed=True)
                np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-2)
        print("ok")
    """)
    env = {**os.environ, "JAXPAGED_CPU_KERNEL_MARCH": "haswell", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("isa", list(cpu_matmul.ISAS))
def test_every_path_row_alone_bit_for_bit(isa):
    """A row's product does not depend on the rows beside it: each of 7 rows alone (the lone-row block)
    equals it in the 7-row call (a 4-row block and the lone-row tail) bit for bit, as stored, transposed and
    packed (what batch_invariant relies on)."""
    _run_path_or_skip(isa)
    rng = np.random.default_rng(13)
    x = _bf16(rng, (7, 576))
    for w, kw in ((_bf16(rng, (576, 160)), {}), (_bf16(rng, (160, 576)), dict(transpose=True)),
                  (cpu_matmul.pack(_bf16(rng, (576, 160))), dict(packed=True))):
        full = np.asarray(cpu_matmul.cpu_matmul(x, w, isa=isa, **kw))
        for m in range(7):
            alone = np.asarray(cpu_matmul.cpu_matmul(x[m:m + 1], w, isa=isa, **kw))
            np.testing.assert_array_equal(alone[0], full[m], err_msg=f"{kw} row {m}")


@pytest.mark.parametrize("isa", list(cpu_matmul.ISAS))
def test_every_path_many_rows_in_pieces(isa):
    """A prefill's many rows over packed weights (shared by the threads in pieces of rows per panel, cpu_vec.h
    ROW_CHUNK): 300 rows (two whole pieces and a partial one with a 4-row and a lone-row tail) over a partial
    panel equal numpy, and the rows past the first piece equal them multiplied alone, bit for bit."""
    _run_path_or_skip(isa)
    rng = np.random.default_rng(300)
    x, w = _bf16(rng, (300, 64)), _bf16(rng, (64, 272))
    tiles = cpu_matmul.pack(w)
    got = np.asarray(cpu_matmul.cpu_matmul(x, tiles, packed=True, isa=isa))
    np.testing.assert_allclose(got, _want(x, w, False), rtol=1e-5, atol=1e-3)
    alone = np.asarray(cpu_matmul.cpu_matmul(x[128:], tiles, packed=True, isa=isa))
    np.testing.assert_array_equal(alone, got[128:])
