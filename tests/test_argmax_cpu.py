"""The CPU argmax kernel (pallas_kernels/argmax/cpu.cc) against jnp.argmax, its reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.argmax import cpu as cpu_argmax

pytestmark = pytest.mark.skipif(not cpu_argmax.available(), reason="the CPU kernel cannot be built here")


@pytest.mark.parametrize("shape", [(64, 49152), (3, 5), (7, 16), (5, 33), (1, 1), (2, 3, 40)])
def test_equals_jnp_argmax(shape):
    """Rows shorter and longer than a vector, a tie (the first wins), a row of -inf (index 0), NaN (the first
    NaN wins), leading axes kept."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = rng.standard_normal(shape).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    rows[0, shape[-1] // 2] = rows[0].max()
    if len(rows) > 1:
        rows[1] = -np.inf
    if len(rows) > 2:
        rows[2, -1] = rows[2, shape[-1] // 3] = np.nan
    got = jax.jit(cpu_argmax.cpu_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        cpu_argmax.cpu_argmax(jnp.zeros((2, 3), jnp.bfloat16))
