"""One heap (jaxpaged/step/host_malloc.py `one_heap`): with EngineConfig made before JAX starts, a compiled
call's temporaries over 64 MB are reused from call to call (no page faults), where a process that
started JAX first maps them fresh every call. Each case runs in a fresh process (the settings must precede
XLA's CPU client)."""
import json
import platform
import subprocess
import sys

import pytest

from jaxpaged.testing.xla_env import subprocess_env


def _huge_pages_always() -> bool:  # then a fresh mapping faults once per 2 MB, not per page
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or _huge_pages_always(),
                                reason="glibc's heap settings, counted in 4 KiB page faults")

# A call whose temporary is 84 MB (the product's [20M / 16, 16] result, of which the sum reads a few rows),
# and the minor page faults of each of its calls. A call's temporary may be freed after its result is ready,
# so the heap may grow while calls overlap: some calls fault, some reuse (none where it is mapped fresh).
SCRIPT = """
import json, resource, sys
if sys.argv[1] == "jax_first":
    import jax; jax.devices()
from jaxpaged.config import EngineConfig
EngineConfig(dtype="float32")
from jaxpaged.step.host_malloc import keep_freed_memory
keep_freed_memory()  # as a CPU engine's runner does
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w: (x.reshape(-1, 16) @ w)[::4096].sum())
x, w, faults = jnp.zeros(20 << 20, jnp.float32), jnp.eye(16), []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
PAGES = (84 << 20) // 4096


def faults(order: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, order], env=subprocess_env(JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_config_first_reuses_the_step_temporaries():
    fresh, kept = faults("jax_first"), faults("config_first")
    assert min(fresh) > PAGES // 2, fresh  # the reference: mapped and faulted anew every call
    assert min(kept[2:]) < PAGES // 100, (kept, fresh)
