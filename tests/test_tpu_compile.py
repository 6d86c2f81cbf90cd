"""The Mosaic TPU kernel and the engine's whole step compiled by libtpu for TPU v5e / v6e on this CPU-only
host (compile-only topology devices; `jax[tpu]` in the `test` extra). Each compile runs in a subprocess
with `jaxpaged/bench/tpu_aot.environment()` (JAX_PLATFORMS=cpu, libtpu quiet), so this process stays CPU-only.
The full table (every bucket, TP 1/4/8, both models, bf16 / int8 KV) is `jaxpaged/bench/tpu_compile_table.py`'s;
here: the kernel on both chips, and two representative steps of the Llama-3-8B-shaped model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxpaged.bench import tpu_aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not tpu_aot.has_libtpu(),
                                reason='libtpu not installed (pip install "jax[tpu]==<jax version>", the test extra)')


def _run(code: str, timeout: int = 900):
    """Run `code` (which prints one line 'OUT' + json) in a compile-only TPU process; its value."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                         env={**os.environ, **tpu_aot.environment()})
    line = [x for x in res.stdout.splitlines() if x.startswith("OUT")]
    assert line, f"compile process failed:\n{res.stderr[-3000:]}"
    return json.loads(line[0][3:])


KERNEL = """
import json, jax, jax.numpy as jnp
from jaxpaged.bench import tpu_aot
from jax.sharding import NamedSharding, PartitionSpec as P
from pallas_kernels.attention.mosaic_tpu import mosaic_tpu_ragged_paged_attention as attn
out = []
for chip in ("v5e", "v6e"):
    mesh = tpu_aot.topology_mesh(chip, 1)
    a = lambda s, d=jnp.int32: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P()))
    for hq, hkv, d, kv, T in [(9, 3, 64, jnp.bfloat16, 64), (32, 8, 128, jnp.int8, 512), (4, 1, 128, jnp.bfloat16, 16)]:
        pools = [a((4096, 16, hkv, d), kv)] * 2
        scales = (dict(k_scale=a((4096, 16, hkv), jnp.float32), v_scale=a((4096, 16, hkv), jnp.float32))
                  if kv == jnp.int8 else {})
        with jax.set_mesh(mesh):
            c = jax.jit(lambda *x, **s: attn(*x, window=100, softcap=30.0, **s)).lower(
                a((T, hq, d), jnp.bfloat16), *pools, a((64, 256)), a((64,)), a((65,)), **scales).compile()
        out.append([chip, d, str(kv), tpu_aot.scoped_vmem(c, "mosaic_tpu_ragged_paged_attention")])
print("OUT" + json.dumps(out))
"""


def test_kernel_compiles_for_v5e_and_v6e():
    """Mosaic accepts the kernel for both chips: head_dim 64 (GQA 3), 128 with an int8 pool, one KV head;
    window and soft-capping on; each got its scoped VMEM."""
    out = _run(KERNEL)
    assert len(out) == 6 and all(vmem > 0 for *_, vmem in out)


@pytest.mark.parametrize("chip,tp,kv,bucket,quant", [("v5e", 4, "bfloat16", 64, None), ("v6e", 8, "int8", 8, "int4")])
def test_llama_8b_step_compiles(chip, tp, kv, bucket, quant):
    """The whole step of the 8B-shaped model, compiled for a TPU slice with the Mosaic kernel inside
    (chosen from the topology's devices), its pool donated and read in place, fitting the chip's HBM; on
    v6e with int4 weights (XLA's dequantize-then-dot), whose bytes are what the step's arguments hold."""
    rows = _run(f"import json; from jaxpaged.bench import tpu_compile_table as t; "
                f"print('OUT' + json.dumps(t.measure({chip!r}, 'llama-3-8b', {tp}, {kv!r}, [{bucket}], {quant!r})))")
    assert len(rows) == 1 and "error" not in rows[0], rows
    r = rows[0]
    assert r["T"] == bucket and r["mosaic_kernels"] >= 1 and r["pool_copies"] == 0
    assert r["fits"] and r["pool_bytes"] > 0 and r["total_bytes"] >= r["pool_bytes"] + r["weight_bytes"] * 0.9
    assert r["predicted"] and r["predicted"][0]["ms"] > 0
    if quant:  # the step's weights: int4 codes (one byte each on this path), float32 scales and minima per 32
        from jaxpaged.bench import tpu_compile_table as t  # (1.25 bytes a weight), the embedding / head int8
        assert r["argument_bytes"] - r["pool_bytes"] < 0.7 * t.weight_bytes(t.model_config("llama-3-8b"), tp)


def test_this_process_stays_on_the_cpu():
    """With libtpu installed, a plain `import jax` in the suite still gets the CPU (conftest keeps the TPU
    probe quiet and local)."""
    import jax
    if jax.devices()[0].platform != "cpu":
        pytest.skip("this host has an accelerator")
    res = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "TPU_SKIP_MDS_QUERY": "1",
                                                      "TPU_WORKER_HOSTNAMES": "localhost"})
    assert res.stdout.strip() == "cpu", res.stderr[-2000:]
