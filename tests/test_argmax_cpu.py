"""The CPU argmax kernel (pallas_kernels/argmax/cpu.cc) against jnp.argmax, its reference: the native build (its
AVX-512 loop on CPUs that have it) and the scalar loop of a haswell build."""
import os
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.argmax import cpu as cpu_argmax
from pallas_kernels.ffi import loader

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


def test_auto_takes_the_kernel_only_with_its_avx512_loop():
    """The engine's sampler takes the kernel where its build has the AVX-512 loop (the one a committed bench
    measures faster than jnp.argmax); elsewhere `auto_skip` says why jnp.argmax runs."""
    if "avx512f" in loader.cpu_flags().split():
        assert cpu_argmax.vector_lanes() == 16 and cpu_argmax.auto_skip() is None
    else:
        assert cpu_argmax.vector_lanes() == 0 and "scalar loop" in cpu_argmax.auto_skip()


def test_scalar_build_equals_jnp_argmax():
    """The kernel built without AVX-512 (-march=haswell, in a subprocess: its own build and registration) runs
    its scalar loop: jnp.argmax's results (ties, -inf rows, NaN), and auto keeps jnp.argmax there."""
    if platform.machine() != "x86_64":
        pytest.skip(f"-march=haswell builds for x86-64; this machine is {platform.machine()}")
    code = textwrap.dedent("""
        import jax.numpy as jnp, numpy as np
        from pallas_kernels.argmax import cpu as cpu_argmax
        assert cpu_argmax.vector_lanes() == 0 and "scalar loop" in cpu_argmax.auto_skip()
        x = np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32)
        x[0, 700] = x[0, 300] = x[0].max() + 1  # a tie: the first wins
        x[1] = -np.inf
        x[2, 999] = x[2, 17] = np.nan
        x[3, 5] = np.inf
        got = cpu_argmax.cpu_argmax(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
        print("ok")
    """)
    env = {**os.environ, "JAXPAGED_CPU_KERNEL_MARCH": "haswell", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
