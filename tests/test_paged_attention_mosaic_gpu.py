"""The Mosaic GPU kernels (decode, ragged) in Mosaic GPU's interpret mode on CPU against the reference.

Interpret mode simulates the kernels' shared memory, TMA copies, barriers and WGMMAs. Two gaps of JAX
0.10's interpreter are worked around and named in docs/kernels.md: register-layout pins
(``plgpu.layout_cast``) have no interpret rule, so interpreted kernels trace without them (identities on
values); and a WGMMA operand given as a transposed view of shared memory (the ``q @ k^T``) is read by the
shim in ``mgpu_interpret.py``, itself checked here. Each case runs once (~5-12 s each on one core).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from mgpu_interpret import original_wgmma, transposed_wgmma
from test_paged_attention_kernels import BS, DECODE_LENS, PAD_ROWS, RAGGED, TOL, make_case, ragged_case, reference

from jaxpaged.step.kv_cache import quantize
from pallas_kernels import paged_attention_reference, ragged_paged_attention_reference
from pallas_kernels.attention.mosaic_gpu_common import interpret_params, smem
from pallas_kernels.attention.mosaic_gpu_decode import mosaic_paged_attention
from pallas_kernels.attention.mosaic_gpu_ragged import mosaic_ragged_paged_attention

LONG_DECODE = DECODE_LENS + [9 * BS + 7]
LONG_RAGGED = RAGGED + [(6 * BS + 3, 40)]


@pytest.fixture(autouse=True)
def _interpreter():
    with transposed_wgmma():
        yield


def _close(out, expect, dtype=jnp.bfloat16):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(jnp.asarray(expect, jnp.float32)), **TOL[dtype])


def _quantized(case, dtype):
    for name in ("k_pool", "v_pool"):
        case[name], case[name[0] + "_scale"] = quantize(case[name].astype(jnp.float32), dtype)
    return case


def _dirty(case, used):
    """Positions past every slot's length (and the null block) hold NaN (int8 pools: their scales)."""
    out = dict(case)
    if case["k_pool"].dtype != jnp.int8:
        out.update(k_pool=case["k_pool"].at[~used].set(jnp.nan), v_pool=case["v_pool"].at[~used].set(jnp.nan))
    if "k_scale" in case:
        out.update(k_scale=case["k_scale"].at[~used].set(jnp.nan), v_scale=case["v_scale"].at[~used].set(jnp.nan))
    return out


def _transposed_dot(a, b, interpret):
    """a [64, K] @ b[N, K]^T on one WGMMA, b given as a transposed view of shared memory."""
    def kernel(a_ref, b_ref, o_ref, a_smem, b_smem, bar):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(b_ref, b_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def dot(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
            return acc_ref[...]
        o_ref[...] = pl.run_scoped(dot, plgpu.ACC((a.shape[0], b.shape[0]), jnp.float32))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), jnp.float32),
                        scratch_types=[smem(a.shape, a.dtype), smem(b.shape, b.dtype),
                                       plgpu.Barrier(num_arrivals=2, num_barriers=1)],
                        interpret=interpret)(a, b)


def test_transposed_operand_shim():
    """The shim multiplies like numpy; JAX 0.10's interpreter alone rejects the transposed operand (when a
    JAX release accepts it, this fails: drop the shim)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
    want = np.asarray(a, np.float32) @ np.asarray(b, np.float32).T
    np.testing.assert_allclose(np.asarray(_transposed_dot(a, b, interpret_params())), want, rtol=1e-5, atol=1e-4)
    with original_wgmma(), pytest.raises(Exception, match="TransposeTransform"):
        jax.block_until_ready(_transposed_dot(a, b, interpret_params()))


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_bf16(splits):
    """GQA 4 (rows padded to 64), every length class, stale NaN past the lengths; with and without splits."""
    case, used = make_case(30, LONG_DECODE, kv_heads=2, group=4, dtype=jnp.bfloat16)
    expect = reference(paged_attention_reference, *case.values())
    _close(mosaic_paged_attention(**_dirty(case, used), interpret=True, num_splits=splits), expect)


def test_decode_options_and_small_blocks():
    """Window + soft cap + scale, block_size 8 (two blocks a step), splits starting past the window."""
    opts = dict(window=24, softcap=5.0, scale=0.3)
    case, _ = make_case(31, LONG_DECODE, group=2, block_size=8, dtype=jnp.float16)
    expect = reference(lambda *a: paged_attention_reference(*a, **opts), *case.values())
    _close(mosaic_paged_attention(**case, **opts, interpret=True, num_splits=2), expect)


def test_decode_group_over_64():
    """A GQA group wider than one WGMMA tile (72 query heads on one KV head) takes two tiles."""
    case, _ = make_case(32, [1, BS + 1, 3 * BS], kv_heads=1, group=72, dtype=jnp.bfloat16)
    _close(mosaic_paged_attention(**case, interpret=True, num_splits=1),
           reference(paged_attention_reference, *case.values()))


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_decode_quantized(dtype):
    """Narrow pools widened in shared memory, their scales folded into the logits and p; stale NaN scales."""
    case, used = make_case(33, LONG_DECODE, group=4, head_dim=128, dtype=jnp.bfloat16)
    case = _quantized(case, dtype)
    expect = reference(lambda *a: paged_attention_reference(*a[:5], k_scale=a[5], v_scale=a[6]), *case.values())
    _close(mosaic_paged_attention(**_dirty(case, used), interpret=True, num_splits=2), expect)


def test_ragged_bf16():
    """Prefills, chunked prefills, decodes, an empty slot, padding rows (zeros); GQA 3 padded to 4; NaN stale."""
    case, used = ragged_case(34, LONG_RAGGED, group=3, dtype=jnp.bfloat16)
    expect = reference(ragged_paged_attention_reference, *case.values())
    out = mosaic_ragged_paged_attention(**_dirty(case, used), interpret=True)
    _close(out, expect)
    assert not np.asarray(out[-PAD_ROWS:].astype(jnp.float32)).any()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_ragged_quantized_with_options(dtype):
    opts = dict(window=24, softcap=5.0)
    case, _ = ragged_case(35, LONG_RAGGED, group=8, dtype=jnp.bfloat16)
    case = _quantized(case, dtype)
    expect = reference(lambda *a: ragged_paged_attention_reference(*a[:6], k_scale=a[6], v_scale=a[7], **opts),
                       *case.values())
    _close(mosaic_ragged_paged_attention(**case, **opts, interpret=True), expect)


def test_limits_are_value_errors():
    case, _ = make_case(36, [3, 20])
    with pytest.raises(ValueError, match="float32 runs on attention_backend='triton'"):
        mosaic_paged_attention(**case, interpret=True)
    small, _ = make_case(36, [3, 20], block_size=4, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="block_size must be >= 8"):
        mosaic_paged_attention(**small, interpret=True)
    rag, _ = ragged_case(37, kv_heads=1, group=72, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="GQA groups up to 64"):
        mosaic_ragged_paged_attention(**rag, interpret=True)
    rag, _ = ragged_case(37, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="block_q x the GQA group"):
        mosaic_ragged_paged_attention(**rag, interpret=True, block_q=8)
    with pytest.raises(ValueError, match="unknown tuning knobs"):
        mosaic_ragged_paged_attention(**rag, interpret=True, num_warps=4)


def test_engine_factory(monkeypatch):
    """attention_backend='mosaic_gpu': refused on a CPU target; on a GPU target the Mosaic GPU kernels take
    16-bit q over 16-bit or 8-bit pools and hand float32 (WGMMA multiplies no float32) to Triton."""
    from pallas_kernels.attention import backends
    with pytest.raises(ValueError, match="cannot run on a CPU target"):
        backends.BACKENDS["mosaic_gpu"].make(True, True)
    handed = []
    monkeypatch.setattr(backends, "_triton", lambda decode_only, interpret: lambda *a, **k: handed.append(a[0].dtype))
    attn = backends.BACKENDS["mosaic_gpu"].make(False, False)
    case, _ = ragged_case(38)
    attn(*case.values())  # float32: Triton's
    assert handed == [jnp.float32]
    bf16 = {k: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v for k, v in case.items()}
    out = jax.eval_shape(attn, *bf16.values())  # traced through the Mosaic GPU kernel
    assert out.shape == case["q"].shape and handed == [jnp.float32]
