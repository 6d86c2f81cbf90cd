"""Several quantized matrices of one x in one kernel call (pallas_kernels/matmul/cpu_quant.py
`cpu_quant_matmuls`, used by jaxpaged/models/quant.py `dots`): bit for bit the per-matrix calls on every path,
with mixed layouts, live rows, stacks at a traced layer, and the operands refused by name; an int8 model's
logits with the fused calls equal those with one call a matrix (the int4 engine's tokens:
tests/test_quant_int4.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_matmul_quant_cpu import PATHS, dense, int8_activations, weights

from pallas_kernels.matmul import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernel cannot be built here")
K = 200  # not a multiple of 16: every layout pads it to its own length (quantized rows of 224 or 256 k)
LAYOUTS = [cq.Layout(K, 40, K, 8, 128),  # int8, one scale a column
           cq.Layout(K, 48, 32, 4, 0, True, 2),  # int4 in groups of 32 with a minimum, float16 scales
           cq.Layout(K, 16, 16, 8, 128, False, 2),  # grouped int8, float16 scales
           cq.Layout(K, 33, 64, 4, 8),  # int4 in groups of 64, float32 scales, a column tail
           cq.Layout(K, 24, 128, 4, 0, True)]  # int4 with a minimum, float32 scales


def packed(rng, layouts, lead=(), dense_too=False):
    """The packed matrices of the layouts (and with `dense_too` each one's float64 W, for 2-D ones)."""
    raw = [weights(rng, a, lead) for a in layouts]
    ws = [cq.pack(*r, a) for r, a in zip(raw, layouts)]
    return (ws, [dense(*r, a) for r, a in zip(raw, layouts)]) if dense_too else ws


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,rows,dtype,act_block", [(1, None, jnp.float32, 32), (5, 3, jnp.bfloat16, 32),
                                                    (13, 13, jnp.float32, 128), (17, 9, jnp.bfloat16, 64)])
def test_fused_equals_each_call(M, rows, dtype, act_block, path):
    """Each product of the fused call equals its own call exactly (every row block, live rows < M, float32
    and bfloat16 x, every activation block) and numpy's reference to float32 summation, the padding rows
    zeros."""
    rng = np.random.default_rng(M)
    ws, wds = packed(rng, LAYOUTS, dense_too=True)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    f = jax.jit(lambda x, r: cq.cpu_quant_matmuls(x, ws, LAYOUTS, rows=r, act_block=act_block, isa=path))
    one = jax.jit(lambda x, w, r, a: cq.cpu_quant_matmul(x, w, a, rows=r, act_block=act_block, isa=path),
                  static_argnums=3)
    live = jnp.int32(M if rows is None else rows)
    got = f(x, live)
    assert len(got) == len(LAYOUTS)
    for y, w, wd, a in zip(got, ws, wds, LAYOUTS):
        assert y.shape == (M, a.N) and y.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(y), np.asarray(one(x, w, live, a)))
        assert not np.asarray(y)[int(live):].any()
        want = int8_activations(np.asarray(x, np.float32)[:int(live)], a, act_block) @ wd  # numpy's
        np.testing.assert_allclose(np.asarray(y)[:int(live)], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fused_stacks_at_a_traced_layer():
    """Stacks [L, ...] read at a traced layer, x with leading axes: each product equals its own call."""
    rng = np.random.default_rng(9)
    layouts = LAYOUTS[:2]
    ws = packed(rng, layouts, (3,))
    x = jnp.asarray(rng.standard_normal((2, 3, K)), jnp.float32)
    f = jax.jit(lambda x, i: cq.cpu_quant_matmuls(x, ws, layouts, layer=i))
    for layer in (0, 2):
        got = f(x, jnp.int32(layer))
        for y, w, a in zip(got, ws, layouts):
            assert y.shape == (2, 3, a.N)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(cq.cpu_quant_matmul(x, w[layer], a)))


def test_fused_bad_operands_are_named():
    """The wrapper and the handler refuse each bad operand of the fused call, naming it."""
    rng = np.random.default_rng(4)
    layouts = LAYOUTS[:3]
    ws = packed(rng, layouts)
    x = jnp.zeros((2, K), jnp.float32)
    other_k = cq.Layout(K + 16, 40, K + 16, 8, 128)
    stacks = packed(rng, layouts[:2], (2,))
    bad = [(lambda: cq.cpu_quant_matmuls(x, ws, layouts[:2]), "one layout a matrix"),
           (lambda: cq.cpu_quant_matmuls(x, [], []), "at least one"),
           (lambda: cq.cpu_quant_matmuls(x, ws, [layouts[0], "int4", layouts[2]]), r"layouts\[1\] must be a Layout"),
           (lambda: cq.cpu_quant_matmuls(x, ws, [layouts[0], other_k, layouts[2]]), r"layouts\[1\] must have K"),
           (lambda: cq.cpu_quant_matmuls(x, [ws[0], ws[2], ws[1]], layouts), r"ws\[1\] must be the packed"),
           (lambda: cq.cpu_quant_matmuls(x, [ws[0], ws[1], ws[2][:, :1]], layouts), r"ws\[2\] must be the packed"),
           (lambda: cq.cpu_quant_matmuls(x, [stacks[0], stacks[1][:1]], layouts[:2], layer=0), "as many layers"),
           (lambda: cq.cpu_quant_matmuls(x[:, :32], ws, layouts), "x must")]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()

    def direct(ws, los=layouts, outs=None, layer=0, **change):
        outs = outs or [a.N for a in los]
        call = jax.ffi.ffi_call(cq.TARGET, [jax.ShapeDtypeStruct((2, n), jnp.float32) for n in outs])
        each = {f: np.array([getattr(a, f) for a in los], np.int64)
                for f in ("N", "group", "bits", "zero", "has_min", "scale_bytes", "superblock")}
        attrs = dict(K=np.int64(K), **each, act_block=np.int64(32), act_bits=np.int64(8), act_outlier=np.float32(0),
                     isa=np.int64(3))
        return [np.asarray(y) for y in call(x, ws[0], jnp.int32(layer), jnp.int32(2), *ws[1:], **{**attrs, **change})]
    assert all(y.shape == (2, a.N) for y, a in zip(direct(ws), layouts))  # the handler called right
    for args, change, match in (
            ((ws,), dict(N=np.array([40, 48], np.int64)), "attribute N must hold one value"),
            (([ws[0], ws[1], ws[2].astype(jnp.int8)],), {}, r"ws\[2\] must be the packed uint8"),
            (([ws[0], ws[2], ws[1]],), {}, r"ws\[1\] must be the packed uint8\[3, 7, 320\]"),
            ((ws, layouts, [40, 48, 17]), {}, r"outs\[2\] must be float32 \[M = 2, N = 16\]"),
            ((ws,), dict(zero=np.array([128, 8, 128], np.int64)), r"ws\[1\]: zero must be a code"),
            ((ws,), dict(bits=np.array([8, 4, 3], np.int64)), r"ws\[2\]: bits must be 4 or 8"),
            ((ws,), dict(scale_bytes=np.array([4, 2, 1], np.int64)), r"ws\[2\]: scale_bytes must be"),
            (([stacks[0], stacks[1][:1]], layouts[:2], None, 1), {},  # layer 1 of a stack of one
             r"layer index must be in \[0, 1\) of ws\[1\]'s stack, got 1")):
        with pytest.raises(Exception, match=match):
            direct(*args, **change)


def one_call_each(x, ws, layouts, **kw):
    """`cpu_quant_matmuls` as one kernel call a matrix (what the fusion replaces): tests patch it in."""
    return tuple(cq.cpu_quant_matmul(x, w, a, **kw) for w, a in zip(ws, layouts))


def test_int8_model_logits_unchanged(tmp_path, monkeypatch):
    """A tiny llama in int8 (one scale a column), packed as the runner packs it: the logits of every
    position with the fused calls equal those with one call a matrix, bit for bit."""
    from test_quant import _all_position_logits

    from jaxpaged.checkpoints.weights import load_params
    from jaxpaged.config import ModelConfig
    from jaxpaged.models import qpacked
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(str(tmp_path / "m"), "llama", seed=3, initializer_range=0.2)
    cfg = ModelConfig.from_dir(path)
    params = qpacked.pack_quantized(load_params(path, cfg, "float32", quantization="int8"))
    assert isinstance(params["layers"]["wq"], qpacked.QPacked) and params["layers"]["wq"].bits == 8
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 250, 21)]
    fused = _all_position_logits(params, cfg, ids)
    monkeypatch.setattr(cq, "cpu_quant_matmuls", one_call_each)  # reached by quant.dots via qpacked.matmuls
    one_each = _all_position_logits(params, cfg, ids)
    np.testing.assert_array_equal(fused, one_each)

