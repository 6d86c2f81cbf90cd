"""The CPU matmul kernel (pallas_kernels/matmul/cpu.cc) against numpy, and through the engine against XLA's dot.

On CPUs with AMX the kernel runs on the tile units; elsewhere its plain-loop path runs the same contract, so
these tests check the shapes, the transposed (tied lm_head) form and the engine's wiring on every machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.quant import dot
from jaxpaged.step.matmul import resolve_matmul
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


def test_amx_path_runs_here():
    """Where the CPU has AMX (amx_bf16, and Linux grants the tiles) the native build multiplies on the tiles,
    and every product test of this module runs that path; elsewhere they run the plain loops, and this says so."""
    flags = set(loader.cpu_flags().split())
    if "amx_bf16" not in flags or "amx_tile" not in flags:
        pytest.skip("AMX untested: this CPU has no amx_bf16 / amx_tile (the products ran the plain loops)")
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
    assert resolve_matmul("auto", jnp.bfloat16, "cpu", 1) is cpu_matmul.amx()
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
        llm = LLM(model=model, **{**engine_kwargs, "dtype": "bfloat16"}, matmul_backend=backend)
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
    """The kernel built without AMX (-march=haswell: the path of every CPU without it) against numpy, in a
    subprocess (its own build and registration)."""
    import os
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from pallas_kernels.matmul import cpu as cpu_matmul
        assert cpu_matmul.available() and not cpu_matmul.amx()
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
