"""The reference attention's query tiling and key chunking never change its result."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import ragged_paged_attention_reference as ragged


@pytest.mark.parametrize("seed", range(4))
def test_tiles_and_chunks_agree_with_one_row_per_tile(seed):
    rng = np.random.default_rng(seed)
    S, bs, Hkv, G, D, N = 5, 4, 2, 3, 16, 200
    kp = jnp.asarray(rng.standard_normal((N, bs, Hkv, D), np.float32))
    vp = jnp.asarray(rng.standard_normal((N, bs, Hkv, D), np.float32))
    n = rng.integers(0, 23, size=S)
    n[rng.integers(S)] = 1
    ctx = jnp.asarray(n + rng.integers(0, 30, size=S), jnp.int32)
    T = int(n.sum()) + int(rng.integers(0, 9))  # padding rows after the last slot
    tables = jnp.asarray(rng.permutation(N - 1)[:S * 16].reshape(S, 16) + 1, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(n)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((T, Hkv * G, D), np.float32))
    want = ragged(q, kp, vp, tables, ctx, qsl, query_tile=1, chunk_blocks=16)
    assert np.all(np.asarray(want[int(n.sum()):]) == 0)
    for tile, cb in ((2, 1), (4, 3), (8, 4), (16, 16)):
        got = jax.jit(functools.partial(ragged, query_tile=tile, chunk_blocks=cb))(q, kp, vp, tables, ctx, qsl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
