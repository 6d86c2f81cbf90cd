"""Every operand of the C++ kernels (attention, matmul, argmax) is checked twice: by the Python wrapper
(ValueError naming it) and by the C++ handler at the FFI boundary (an error naming it, seen here by calling
the FFI target directly, past the wrapper). A mis-sized operand would otherwise be read out of bounds
(tests/test_kernel_sanitizers.py shows where under AddressSanitizer)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.argmax import cpu as cpu_argmax
from pallas_kernels.attention import cpu as cpu_attention
from pallas_kernels.matmul import cpu as cpu_matmul

S, B, NB, BS, HKV, G, D, T = 3, 4, 16, 8, 2, 2, 32, 6


def _attention_operands():
    """Valid operands of the attention kernel: q [T, Hq, D], pools [NB, BS, Hkv, D], tables [S, B], lens [S],
    query_start_loc [S + 1]."""
    rng = np.random.default_rng(0)
    pool = lambda: jnp.asarray(rng.standard_normal((NB, BS, HKV, D)), jnp.float32)  # noqa: E731
    return dict(q=jnp.asarray(rng.standard_normal((T, HKV * G, D)), jnp.float32), k_pool=pool(), v_pool=pool(),
                block_tables=jnp.asarray(rng.permutation(NB)[:S * B].reshape(S, B), jnp.int32),
                seq_lens=jnp.array([5, 20, 31], jnp.int32), query_start_loc=jnp.array([0, 1, 4, 6], jnp.int32))


# (operand, a wrong value of it); the checks on the wrapper and in C++ both name the operand
ATTENTION_BAD = [
    ("q", lambda a: a["q"].astype(jnp.int32)),                    # not floats
    ("q", lambda a: a["q"][0]),                                   # not [T, Hq, D]
    ("k_pool", lambda a: a["k_pool"][..., : D // 2]),             # head_dim differs from q's
    ("k_pool", lambda a: jnp.concatenate([a["k_pool"]] * 3, axis=2)[..., :3, :]),  # 3 KV heads, 4 q heads
    ("k_pool", lambda a: a["k_pool"].astype(jnp.float16)),        # a dtype the kernel does not read (C++)
    ("v_pool", lambda a: a["v_pool"][: NB // 2]),                 # fewer blocks than k_pool
    ("v_pool", lambda a: a["v_pool"][:, :, :, : D // 2]),         # a shorter head_dim than k_pool's
    ("v_pool", lambda a: a["v_pool"].astype(jnp.bfloat16)),       # another dtype than k_pool's
    ("block_tables", lambda a: a["block_tables"][0]),             # not [S, B]
    ("seq_lens", lambda a: a["seq_lens"][:1]),                    # fewer than S entries
    ("query_start_loc", lambda a: a["query_start_loc"][:S]),      # S entries, not S + 1
    ("query_start_loc", lambda a: a["query_start_loc"].astype(jnp.float32)),  # not integers
]


def _attention_ffi(a):
    """The FFI target called directly with `a` as given (no wrapper: no check, no cast)."""
    call = jax.ffi.ffi_call(cpu_attention.TARGET, jax.ShapeDtypeStruct((T, HKV * G, D), jnp.float32))
    return call(*a.values(), scale=np.float32(D ** -0.5), window=np.int64(0), softcap=np.float32(0))


@pytest.mark.parametrize("case", range(len(ATTENTION_BAD)))
def test_attention_names_the_operand(case):
    name, bad = ATTENTION_BAD[case]
    a = _attention_operands()
    a[name] = bad(a)
    if not (name == "k_pool" and a[name].dtype == jnp.float16):  # a float16 pool: the wrapper takes the reference
        with pytest.raises(ValueError, match=f"^{name} must"):
            cpu_attention.cpu_ragged_paged_attention(*a.values())
    if cpu_attention.available():
        with pytest.raises(Exception, match=f"cpu_paged_attention: {name} must"):
            jax.block_until_ready(_attention_ffi(a))


def test_attention_ffi_checks_the_output_and_accepts_valid_operands():
    if not cpu_attention.available():
        pytest.skip("the CPU attention kernel cannot be built here")
    a = _attention_operands()
    want = cpu_attention.ragged_paged_attention_reference(*a.values())
    np.testing.assert_allclose(np.asarray(_attention_ffi(a)), np.asarray(want), atol=2e-5, rtol=2e-5)
    call = jax.ffi.ffi_call(cpu_attention.TARGET, jax.ShapeDtypeStruct((T - 1, HKV * G, D), jnp.float32))
    with pytest.raises(Exception, match="cpu_paged_attention: out must"):
        jax.block_until_ready(call(*a.values(), scale=np.float32(1), window=np.int64(0), softcap=np.float32(0)))


def _matmul_ffi(x, w, layer, n, transpose=0, packed=0, m=None, rows=None):
    m = x.shape[0] if m is None else m
    call = jax.ffi.ffi_call(cpu_matmul.TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    rows = jnp.int32(x.shape[0] if rows is None else rows)
    return call(x, w, layer, rows, transpose=np.int64(transpose), packed=np.int64(packed), isa=np.int64(3))


def test_matmul_names_the_operand():
    if not cpu_matmul.available():
        pytest.skip("the CPU matmul kernel cannot be built here")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    one = jnp.zeros((), jnp.int32)
    np.testing.assert_allclose(np.asarray(_matmul_ffi(x, w, one, 48)),
                               np.asarray(x, np.float32) @ np.asarray(w, np.float32), rtol=1e-5, atol=1e-3)
    for wrapper_args, ffi_args, name in [
        ((x[:, :32], w), (x[:, :32], w, one, 48), "w"),                  # K differs between x and w
        ((x.astype(jnp.float32), w), (x.astype(jnp.float32), w, one, 48), "x"),  # not bfloat16
        ((x, w[None]), (x, w[None], jnp.int32(1), 48), "layer"),          # a layer past the stack
        ((x, w.T), (x, w.T, one, 64), "w"),                               # [N, K] without transpose
        (None, (x, w, jnp.zeros((2,), jnp.int32), 48), "layer"),         # not one index
        (None, (x, w, one, 64), "out"),                                   # an output of another width
        (None, (x, w, one, 48, 0, 0, 6), "out"),                          # ... of more rows than x
        (None, (x, w, one, 48, 0, 0, None, 6), "rows"),                   # more live rows than x has
        (None, (x, w, one, 48, 0, 0, None, -1), "rows"),
    ]:
        if wrapper_args is not None and name != "layer":
            with pytest.raises(ValueError, match="got x .*, w "):
                cpu_matmul.cpu_matmul(*wrapper_args)
        with pytest.raises(Exception, match=f"cpu_matmul: {name}"):
            jax.block_until_ready(_matmul_ffi(*ffi_args))
    packed = cpu_matmul.pack(w)
    with pytest.raises(Exception, match="cpu_matmul: w"):  # packed tiles for a wider K than x's
        jax.block_until_ready(_matmul_ffi(x[:, :32], packed, one, 48, packed=1))


def test_matmul_of_several_matrices_checks_each():
    """One call of several matrices (`cpu_matmuls`): one out per w, and every w checked as the first is."""
    if not cpu_matmul.available():
        pytest.skip("the CPU matmul kernel cannot be built here")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    w, w2 = (jnp.asarray(rng.standard_normal((64, n)), jnp.bfloat16) for n in (48, 32))
    one, rows = jnp.zeros((), jnp.int32), jnp.int32(5)
    attrs = dict(transpose=np.int64(0), packed=np.int64(0), isa=np.int64(3))
    out = lambda *ns: [jax.ShapeDtypeStruct((5, n), jnp.float32) for n in ns]
    got = jax.ffi.ffi_call(cpu_matmul.TARGET, out(48, 32))(x, w, one, rows, w2, **attrs)
    xf = np.asarray(x, np.float32)
    for g, m in zip(got, (w, w2)):
        np.testing.assert_allclose(np.asarray(g), xf @ np.asarray(m, np.float32), rtol=1e-5, atol=1e-3)
    for outs, more, match in [(out(48), (w2,), "one out per w"),          # two w, one out
                              (out(48, 32), (w2[:32],), "cpu_matmul: w"),  # the second w's K is not x's
                              (out(48, 16), (w2,), "cpu_matmul: out")]:    # the second out of another width
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(jax.ffi.ffi_call(cpu_matmul.TARGET, outs)(x, w, one, rows, *more, **attrs))


def test_argmax_names_the_operand():
    if not cpu_argmax.available():
        pytest.skip("the CPU argmax kernel cannot be built here")
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 40)), jnp.float32)
    with pytest.raises(ValueError, match="cpu_argmax needs float32 x"):
        cpu_argmax.cpu_argmax(x[:, :0])
    for arg, rows, name in [(x.astype(jnp.bfloat16), 4, "x"), (x[0], 4, "x"), (x, 9, "out")]:
        call = jax.ffi.ffi_call(cpu_argmax.TARGET, jax.ShapeDtypeStruct((rows,), jnp.int32))
        with pytest.raises(Exception, match=f"cpu_argmax: {name} must"):
            jax.block_until_ready(call(arg))
