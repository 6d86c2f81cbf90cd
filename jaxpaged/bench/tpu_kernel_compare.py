"""Our Mosaic TPU ragged kernel (today's pool layout, K and V apart) against JAX's shipped TPU kernel
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, one fused KV pool with K and V heads
interleaved), both compiled by libtpu for v5e and v6e with no TPU present: the scoped VMEM each kernel
was given, its scheduled bundles (libtpu's own count), and how many pool-sized copies XLA had to add in
front of it (a layout the pool does not have). Same tiles for both: 128 keys a step, 16 query rows a
program for a decode step (T = S = 64), 32 for a mixed step (T = 512, S = 64); bf16, block size 16.

    jaxpaged bench tpu_kernel_compare [--out docs/results/tpu_kernels.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from jaxpaged.bench import tpu_aot

# name, q heads, KV heads, head_dim (per device)
SHAPES = [("SmolLM2-135M, TP=1", 9, 3, 64), ("Llama-3-8B, TP=1", 32, 8, 128), ("Llama-3-8B, TP=4", 8, 2, 128)]
STEPS = [("decode", 64, 64, 16), ("mixed", 512, 64, 32)]  # name, T, S, query rows a program
BS, POOL_BYTES = 16, 512 * 2**20  # pools of ~512 MiB each, far larger than VMEM (as in a real engine)


def _compile_one(chip, kernel, shape, step, dump):
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.attention.mosaic_tpu import mosaic_tpu_ragged_paged_attention
    _, Hq, Hkv, D = shape
    _, T, S, bq = step
    mesh = tpu_aot.topology_mesh(chip, 1)
    rep = NamedSharding(mesh, P())
    N = POOL_BYTES // (BS * Hkv * D * 2)
    B = 4096 // BS  # 4k-token contexts at most

    def arg(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    q = arg((T, Hq, D), jnp.bfloat16)
    if kernel == "ours":
        fn = functools.partial(mosaic_tpu_ragged_paged_attention, block_q=bq, blocks_per_iter=128 // BS)
        args = (q, arg((N, BS, Hkv, D), jnp.bfloat16), arg((N, BS, Hkv, D), jnp.bfloat16), arg((S, B)), arg((S,)),
                arg((S + 1,)))
        name = "mosaic_tpu_ragged_paged_attention"
    else:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
        fn = functools.partial(ragged_paged_attention, sm_scale=D ** -0.5, num_kv_pages_per_block=128 // BS,
                               num_queries_per_block=bq)
        args = (q, arg((N, BS, 2 * Hkv, D), jnp.bfloat16), arg((S,)), arg((S, B)), arg((S + 1,)), arg((1,)))
        name = "ragged_paged_attention_kernel"
    before = set(os.listdir(dump))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    new = tempfile.mkdtemp(prefix="tpu_kernel_")
    for f in set(os.listdir(dump)) - before:  # this compile's files only
        os.rename(os.path.join(dump, f), os.path.join(new, f))
    bundles = tpu_aot.bundle_counts(new, name)
    return dict(scoped_vmem_bytes=tpu_aot.scoped_vmem(compiled, name), bundles=max(bundles) if bundles else None,
                pool_copies=tpu_aot.pool_copies(compiled, POOL_BYTES // 2))


def measure(chip: str, dump: str) -> list[dict]:
    """Every (kernel, shape, step) on one chip, in a process whose libtpu dumps to `dump`; a kernel that
    does not compile records its error."""
    rows = []
    for shape in SHAPES:
        for step in STEPS:
            for kernel in ("ours", "jax"):
                row = dict(chip=chip, kernel=kernel, model=shape[0], step=step[0], T=step[1], S=step[2])
                try:
                    row.update(_compile_one(chip, kernel, shape, step, dump))
                except Exception as e:  # noqa: BLE001 -- recorded: that the kernel cannot serve this shape
                    row["error"] = str(e).strip().splitlines()[0][:200]
                rows.append(row)
    return rows


def table(rows) -> str:
    out = ["| chip | model (per device) | step | ours: VMEM KiB / bundles / pool copies | "
           "JAX fused: VMEM KiB / bundles / pool copies |", "| --- | --- | --- | --- | --- |"]
    cell = lambda r: (f"not served ({r['error'][:60]})" if "error" in r else
                      f"{r['scoped_vmem_bytes'] / 1024:.0f} / {r['bundles']} / {r['pool_copies']}")
    for r in rows:
        if r["kernel"] == "ours":
            same = ("chip", "model", "step")
            jaxr = next(j for j in rows if j["kernel"] == "jax" and all(j[k] == r[k] for k in same))
            out.append(f"| {r['chip']} | {r['model']} | {r['step']} (T={r['T']}) | {cell(r)} | {cell(jaxr)} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/tpu_kernels.json")
    ap.add_argument("--chip", action="append", choices=sorted(tpu_aot.CHIPS), help="default: every chip")
    args = ap.parse_args(argv)
    rows = []
    for chip in args.chip or sorted(tpu_aot.CHIPS):  # one process a chip: libtpu's dump flag is per process
        dump = tempfile.mkdtemp(prefix="libtpu_dump_")
        code = ("import json; from jaxpaged.bench import tpu_kernel_compare as t; "
                f"print('ROWS' + json.dumps(t.measure({chip!r}, {dump!r})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **tpu_aot.environment(dump)})
        line = [x for x in res.stdout.splitlines() if x.startswith("ROWS")]
        if not line:
            raise SystemExit(f"{chip}: compile process failed:\n{res.stderr[-3000:]}")
        rows += json.loads(line[0][4:])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
