"""Sliding window, logit soft-capping and an explicit scale: reference vs dense softmax, kernels vs reference.

The kernels run in interpret mode on CPU (natively under the ``gpu`` marker)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_kernels import (
    DECODE_LENS,
    ON_GPU,
    PAD_ROWS,
    RAGGED,
    assert_close,
    dense_attention,
    lowered_for_cuda,
    make_case,
    ragged_case,
    reference,
)

from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

# window 1 (only itself), shorter than a block, crossing blocks, longer than every context
OPTIONS = [dict(window=1), dict(window=5, softcap=2.0), dict(window=24, scale=0.3), dict(softcap=1.5),
           dict(window=1000, softcap=30.0, scale=0.05)]
IDS = ["w1", "w5-cap2", "w24-scale", "cap1.5", "wbig-cap30-scale"]
# long slots so that windows leave whole blocks behind (and key splits start past them)
LONG_RAGGED = RAGGED + [(6 * 16 + 3, 40), (5 * 16, 1)]
LONG_DECODE = DECODE_LENS + [9 * 16 + 7]


def _ref(fn, opts):
    return functools.partial(fn, **opts)


@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
def test_reference_matches_dense(opts):
    case, _ = ragged_case(20, LONG_RAGGED, group=2)
    want = dense_attention(**case, **opts)
    got = reference(_ref(ragged_paged_attention_reference, opts), *case.values())
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # one row per tile (decode-like) takes the other path of the reference
    got1 = ragged_paged_attention_reference(**case, **opts, query_tile=1)
    np.testing.assert_allclose(got1, want, atol=1e-5, rtol=1e-5)
    dec, _ = make_case(21, LONG_DECODE, group=4)
    qsl = jnp.arange(len(LONG_DECODE) + 1, dtype=jnp.int32)
    np.testing.assert_allclose(reference(_ref(paged_attention_reference, opts), *dec.values()),
                               dense_attention(**dec, query_start_loc=qsl, **opts), atol=1e-5, rtol=1e-5)


def test_window_changes_the_output():
    """The options are not ignored: a window shorter than the context changes the rows that see past it."""
    case, _ = ragged_case(22, LONG_RAGGED)
    full = np.asarray(ragged_paged_attention_reference(**case))
    win = np.asarray(ragged_paged_attention_reference(**case, window=5))
    capped = np.asarray(ragged_paged_attention_reference(**case, softcap=0.5))
    assert np.abs(full - win).max() > 0.1 and np.abs(full - capped).max() > 0.1


def test_blocks_outside_the_window_may_hold_anything():
    """What the block manager does to blocks that left every window (frees them: they get reused) does
    not reach the output: NaN in every block wholly outside all windows."""
    bs, w = 16, 20
    case, used = ragged_case(23, LONG_RAGGED)
    want = reference(_ref(ragged_paged_attention_reference, dict(window=w)), *case.values())
    tables, lens = np.asarray(case["block_tables"]), np.asarray(case["seq_lens"])
    qsl = np.asarray(case["query_start_loc"])
    dirty_k, dirty_v = np.asarray(case["k_pool"]).copy(), np.asarray(case["v_pool"]).copy()
    for i, L in enumerate(lens):
        first_q = L - (qsl[i + 1] - qsl[i])
        for j in range(max(first_q - w + 1, 0) // bs):  # blocks no query of slot i can see
            dirty_k[tables[i, j]] = dirty_v[tables[i, j]] = np.nan
    dirty = dict(case, k_pool=jnp.asarray(dirty_k), v_pool=jnp.asarray(dirty_v))
    assert np.isnan(dirty_k).any()
    np.testing.assert_allclose(ragged_paged_attention_reference(**dirty, window=w), want, atol=1e-6)
    np.testing.assert_allclose(ragged_paged_attention(**dirty, window=w, interpret=not ON_GPU), want,
                               atol=1e-4, rtol=1e-4)


class TestKernelOptions:
    interpret = not ON_GPU

    @pytest.mark.parametrize("opts", OPTIONS[:3], ids=IDS[:3])
    @pytest.mark.parametrize("splits", [1, 3])
    def test_decode(self, opts, splits):
        case, _ = make_case(24, LONG_DECODE, group=2, block_size=8)
        out = paged_attention(**case, **opts, num_splits=splits, blocks_per_iter=2, interpret=self.interpret)
        assert_close(out, reference(_ref(paged_attention_reference, opts), *case.values()), jnp.float32)

    @pytest.mark.parametrize("opts", OPTIONS[:3], ids=IDS[:3])
    def test_ragged(self, opts):
        case, _ = ragged_case(25, LONG_RAGGED, group=4)
        out = ragged_paged_attention(**case, **opts, block_q=16, blocks_per_iter=1, interpret=self.interpret)
        assert_close(out, reference(_ref(ragged_paged_attention_reference, opts), *case.values()),
                     jnp.float32)
        assert not np.asarray(out[-PAD_ROWS:]).any()

    def test_bfloat16(self):
        opts = dict(window=24, softcap=5.0)
        case, _ = ragged_case(26, LONG_RAGGED, dtype=jnp.bfloat16)
        assert_close(ragged_paged_attention(**case, **opts, interpret=self.interpret),
                     reference(_ref(ragged_paged_attention_reference, opts), *case.values()), jnp.bfloat16)


def test_option_errors():
    case, _ = make_case(27, [3, 20])
    for bad, msg in [(dict(window=0), "window"), (dict(window=2.5), "window"), (dict(softcap=-1.0), "softcap")]:
        for fn in (paged_attention, paged_attention_reference):
            with pytest.raises(ValueError, match=msg):
                fn(**case, **bad, **({"interpret": True} if fn is paged_attention else {}))


def test_options_lower_to_triton_for_cuda():
    """Cross-lowered for CUDA on any machine: the window bounds and tanh have Triton lowerings."""
    import jax
    b = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    i = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    pool = b(100, 16, 2, 128)
    cases = [(lambda *a: paged_attention(*a, window=64, softcap=50.0, scale=0.1, num_splits=2),
              (b(4, 8, 128), pool, pool, i(4, 16), i(4))),
             (lambda *a: ragged_paged_attention(*a, window=64, softcap=50.0), (b(64, 8, 128), pool, pool,
                                                                               i(4, 16), i(4), i(5)))]
    for fn, args in cases:
        assert "triton" in lowered_for_cuda(fn, args)
