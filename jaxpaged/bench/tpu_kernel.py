"""Benchmark the Mosaic TPU ragged kernel on the TPU at hand (scripts/tpu_check.sh runs it).

Decode steps (one query per slot) over a batch x context grid and one mixed step (decodes plus prefill
chunks), Llama-3-8B heads per chip (32 q / 8 KV heads of 128, bf16, blocks of 16). Each shape: our kernel,
JAX's shipped TPU kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) on the same K/V
re-laid out to its fused pool, and the plain-JAX reference; the largest difference from the reference;
achieved bandwidth = K/V bytes read / time, against a device-to-device copy timed in the same run. Results
are rewritten after every measurement (``results.json``, ``results.md`` in --out).

    jaxpaged bench tpu_kernel --out DIR [--time-budget 300]   # TPU
    jaxpaged bench tpu_kernel --cpu-smoke --out DIR            # tiny shapes, TPU interpret mode
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.bench import timing
from pallas_kernels.attention.mosaic_tpu import mosaic_tpu_ragged_paged_attention
from pallas_kernels.attention.reference import ragged_paged_attention_reference

TPU = dict(Hq=32, Hkv=8, D=128, bs=16, batches=[1, 8, 64, 256], contexts=[512, 4096], mixed=(64, 4096, [512, 512]),
           copy_bytes=1 << 30)
SMOKE = dict(Hq=4, Hkv=2, D=64, bs=16, batches=[2], contexts=[40], mixed=(2, 40, [20]), copy_bytes=1 << 20)


def _time(fn, *args, reps=10):
    """Seconds per call of `reps` back-to-back calls, after one untimed."""
    return timing.samples(fn, *args, reps=1, calls=reps)[0]


def make_step(cfg, decodes, ctx, prefills=(), seed=0):
    """A step of `decodes` one-row slots at context `ctx` and prefill chunks (rows, context) after them."""
    rng = np.random.default_rng(seed)
    slots = [(ctx, 1)] * decodes + [(c, c if c <= 512 else 512) for c in prefills]
    bs, Hkv, D = cfg["bs"], cfg["Hkv"], cfg["D"]
    need = [-(-c // bs) for c, _ in slots]
    N, B = 1 + sum(need), max(need)
    tables = np.zeros((len(slots), B), np.int32)
    ids = rng.permutation(np.arange(1, N))
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at:at + n]
        at += n
    qsl = np.concatenate([[0], np.cumsum([q for _, q in slots])]).astype(np.int32)
    k = jax.random.normal(jax.random.key(seed), (N, bs, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(seed + 1), (N, bs, Hkv, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(seed + 2), (int(qsl[-1]), cfg["Hq"], D), jnp.bfloat16)
    kv_bytes = 2 * sum(c for c, _ in slots) * Hkv * D * 2
    return dict(q=q, k_pool=k, v_pool=v, block_tables=jnp.asarray(tables),
                seq_lens=jnp.asarray([c for c, _ in slots], jnp.int32), query_start_loc=jnp.asarray(qsl)), kv_bytes


def jax_fused(case):
    """JAX's shipped TPU kernel on the same step: K and V interleaved in one pool [N, bs, 2*Hkv, D]."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    k, v = case["k_pool"], case["v_pool"]
    kv = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3])
    S = case["seq_lens"].shape[0]
    fn = jax.jit(lambda q, kv, *a: ragged_paged_attention(q, kv, *a, sm_scale=q.shape[-1] ** -0.5,
                                                          num_kv_pages_per_block=8, num_queries_per_block=32))
    return fn, (case["q"], kv, case["seq_lens"], case["block_tables"], case["query_start_loc"],
                jnp.asarray([S], jnp.int32))


def measure(cfg, name, case, kv_bytes, interpret, copy_bw, results):
    ours = jax.jit(lambda **c: mosaic_tpu_ragged_paged_attention(**c, interpret=interpret))
    ref = jax.jit(lambda **c: ragged_paged_attention_reference(**c))
    want = ref(**case)
    got = ours(**case)
    row = dict(shape=name, kv_mib=kv_bytes / 2**20,
               max_abs_diff=float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))))
    if not interpret:
        row["ours_ms"] = 1e3 * _time(lambda c: ours(**c), case)
        row["ours_gbps"] = kv_bytes / row["ours_ms"] / 1e6
        row["ours_of_copy"] = row["ours_gbps"] * 1e9 / copy_bw
        row["reference_ms"] = 1e3 * _time(lambda c: ref(**c), case)
        try:
            fn, args = jax_fused(case)
            row["jax_fused_ms"] = 1e3 * _time(fn, *args)
        except Exception as e:  # noqa: BLE001 -- recorded, the rest still runs
            row["jax_fused_error"] = str(e).splitlines()[0][:200]
    results["rows"].append(row)
    print(json.dumps(row), flush=True)


def write(out, results):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    cols = ["shape", "kv_mib", "ours_ms", "ours_gbps", "ours_of_copy", "jax_fused_ms", "reference_ms", "max_abs_diff"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in results["rows"]:
        cells = (f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols)
        lines.append("| " + " | ".join(cells) + " |")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"device: {results['device']}, copy {results['copy_gbps']:.0f} GB/s\n\n" + "\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_tpu_out"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in TPU interpret mode (CI)")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds; later shapes are skipped")
    args = ap.parse_args(argv)
    cfg, interpret = (SMOKE, True) if args.cpu_smoke else (TPU, False)
    os.makedirs(args.out, exist_ok=True)
    x = jnp.ones(cfg["copy_bytes"] // 4, jnp.float32)
    copy_s = _time(jax.jit(lambda a: a + 1), x) if not interpret else 1.0
    results = dict(device=str(jax.devices()[0]), copy_gbps=2 * cfg["copy_bytes"] / copy_s / 1e9, rows=[])
    copy_bw = 2 * cfg["copy_bytes"] / copy_s
    t0 = time.monotonic()
    shapes = [(f"decode {b} x {c}", (b, c, ())) for c in cfg["contexts"] for b in cfg["batches"]]
    d, c, pre = cfg["mixed"]
    shapes.append((f"mixed {d} x {c} + prefill {pre}", (d, c, pre)))
    for name, (b, c, pre) in shapes:
        if time.monotonic() - t0 > args.time_budget:
            results["rows"].append(dict(shape=name, skipped="time budget"))
            continue
        try:
            case, kv_bytes = make_step(cfg, b, c, pre)
            measure(cfg, name, case, kv_bytes, interpret, copy_bw, results)
        except Exception:  # noqa: BLE001 -- recorded, the next shape still runs
            results["rows"].append(dict(shape=name, error=traceback.format_exc()[-500:]))
        write(args.out, results)
    return results


if __name__ == "__main__":
    main()
