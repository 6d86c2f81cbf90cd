"""Benchmark the Pallas paged-attention kernels on the device at hand.

Decode (``paged_attention``) over a batch x context grid, and one mixed prefill/decode step
(``ragged_paged_attention``), each against the plain-JAX reference and, for decode, JAX's shipped
``jax.experimental.pallas.ops.gpu.paged_attention`` on the same data re-laid out. Achieved bandwidth is
K/V bytes read / time, set against a device-to-device copy measured in the same run. Every part is
guarded and results are rewritten after each measurement: ``results.json`` and ``results.md`` in --out.

    jaxpaged bench kernels --out DIR [--time-budget 300]   # GPU
    jaxpaged bench kernels --cpu-smoke --out DIR            # tiny shapes, interpret mode
    jaxpaged bench kernels --kv-dtype float8_e4m3fn --out DIR   # decode over a quantized pool

With --kv-dtype int8 / float8_e4m3fn the pool holds quantized values with one float32 scale per token
per KV head (jaxpaged/step/kv_cache.py): only the decode grid runs (the shipped kernel and the ragged kernel's
timing are for the model dtype's pool), and the bytes read count the narrow values plus the scales.
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
from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.attention.mosaic_gpu_decode import mosaic_paged_attention
from pallas_kernels.attention.mosaic_gpu_ragged import mosaic_ragged_paged_attention

# --backend: (decode, ragged) kernels and the decode tuning sweep of each
KERNELS = {"triton": (paged_attention, ragged_paged_attention), "mosaic": (mosaic_paged_attention,
                                                                          mosaic_ragged_paged_attention)}
MOSAIC_SWEEP = [dict(blocks_per_iter=2), dict(blocks_per_iter=8), dict(num_stages=3), dict(num_stages=4),
                dict(num_splits=2)]

GPU = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
           batches=[1, 8, 32, 64, 128, 256], contexts=[512, 4096, 32768], max_tokens=1 << 21,
           copy_bytes=1 << 30, ragged=dict(decodes=64, decode_ctx=4096, prefills=[(512, 1024), (512, 4096)]),
           sweep_shape=(64, 4096),
           sweep=[dict(blocks_per_iter=2), dict(blocks_per_iter=8), dict(blocks_per_iter=8, num_warps=8),
                  dict(num_warps=8), dict(num_stages=3), dict(num_splits=2)])
SMOKE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16",
             batches=[2], contexts=[48], max_tokens=1 << 10, copy_bytes=1 << 20,
             ragged=dict(decodes=2, decode_ctx=48, prefills=[(16, 40)]),
             sweep_shape=(2, 48), sweep=[dict(blocks_per_iter=2)])


def timeit(fn, *args, reps=3, min_time=0.05):
    """Seconds per call: compile once, then the best of `reps` batches of back-to-back async calls."""
    (once,) = timing.samples(fn, *args, reps=1)
    n = max(1, min(200, int(min_time / max(once, 1e-6))))
    return min(timing.samples(fn, *args, reps=reps, calls=n, warmup=0))


def copy_bandwidth(nbytes):
    """Bytes/s of a device-to-device copy (read + write counted), the best of two ways to copy."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    ways = {"copy": jax.jit(lambda a: a.copy()), "add": jax.jit(lambda a: a + 1)}
    return {name: 2 * x.nbytes / timeit(fn, x) for name, fn in ways.items()}


def jax_shipped_kernel():
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as shipped
        return shipped
    except Exception:  # noqa: BLE001 - absent or broken in this JAX version
        return None


def make_pool(cfg, num_blocks, key):
    """(k_pool, v_pool) of random values, and {k_scale, v_scale} when cfg["kv_dtype"] is quantized."""
    bs, hkv, d = cfg["block_size"], cfg["num_kv_heads"], cfg["head_dim"]
    kk, kv = jax.random.split(key)
    shape = (num_blocks, bs, hkv, d)
    k, v = jax.random.normal(kk, shape, cfg["dtype"]), jax.random.normal(kv, shape, cfg["dtype"])
    if not cfg.get("kv_dtype"):
        return (k, v), {}
    from jaxpaged.step.kv_cache import quantize
    (k, ks), (v, vs) = quantize(k, cfg["kv_dtype"]), quantize(v, cfg["kv_dtype"])
    return (k, v), dict(k_scale=ks, v_scale=vs)


def decode_case(cfg, batch, ctx, num_blocks, key):
    bs = cfg["block_size"]
    B = ctx // bs
    kq, kt = jax.random.split(key)
    q = jax.random.normal(kq, (batch, cfg["num_q_heads"], cfg["head_dim"]), cfg["dtype"])
    ids = jax.random.permutation(kt, num_blocks - 1)[: batch * B] + 1  # never the null block
    tables = ids.reshape(batch, B).astype(jnp.int32)
    return q, tables, jnp.full((batch,), ctx, jnp.int32)


def kv_bytes(cfg, tokens):
    """K and V bytes of `tokens` tokens: values (in the pool's dtype) and, when quantized, their scales."""
    per_head = cfg["head_dim"] * jnp.dtype(cfg.get("kv_dtype") or cfg["dtype"]).itemsize + 4 * bool(cfg.get("kv_dtype"))
    return tokens * cfg["num_kv_heads"] * 2 * per_head


def bench_decode(cfg, pool, batch, ctx, key, interpret, peak, shipped, tuning=None):
    (k_pool, v_pool), scales = pool
    q, tables, lens = decode_case(cfg, batch, ctx, k_pool.shape[0], key)
    rec = dict(batch=batch, context=ctx, kv_bytes=kv_bytes(cfg, batch * ctx), tuning=tuning or "default",
               kv_dtype=cfg.get("kv_dtype") or cfg["dtype"])
    decode = KERNELS[cfg["backend"]][0]
    ours = jax.jit(lambda *a: decode(*a, interpret=interpret, **scales, **(tuning or {})))
    ref = jax.jit(lambda *a: paged_attention_reference(*a, **scales))
    out = ours(q, k_pool, v_pool, tables, lens)
    expect = ref(q, k_pool, v_pool, tables, lens)
    rec["max_abs_err_vs_ref"] = float(jnp.abs(out.astype(jnp.float32) - expect.astype(jnp.float32)).max())
    rec["ours_s"] = timeit(ours, q, k_pool, v_pool, tables, lens)
    rec["ours_bw"] = rec["kv_bytes"] / rec["ours_s"]
    rec["ours_frac_copy"] = rec["ours_bw"] / peak
    if tuning:
        return rec
    guarded(rec, "ref", lambda: timeit(ref, q, k_pool, v_pool, tables, lens))
    if shipped is not None:
        def run_shipped():
            pages = ctx // cfg["block_size"]
            splits = max(s for s in (1, 2, 4, 8, 16) if pages % s == 0)
            fn = jax.jit(lambda q, k, v, t, l: shipped(q, k, v, t, l, k_splits=splits, interpret=interpret))
            kp, vp = (jnp.transpose(x, (2, 0, 1, 3)) for x in pool[0])  # [Hkv, N, bs, D]
            qs = (q.astype(jnp.float32) * cfg["head_dim"] ** -0.5).astype(q.dtype)  # it does not scale
            theirs = fn(qs, kp, vp, tables, lens)
            rec["jax_max_abs_diff"] = float(jnp.abs(theirs.astype(jnp.float32) - out.astype(jnp.float32)).max())
            return timeit(fn, qs, kp, vp, tables, lens)
        guarded(rec, "jax", run_shipped)
    return rec


def bench_ragged(cfg, pool, key, interpret, peak):
    (k_pool, v_pool), _ = pool  # the model dtype's pool (main skips this with --kv-dtype)
    r, bs = cfg["ragged"], cfg["block_size"]
    ctxs = [r["decode_ctx"]] * r["decodes"] + [c for _, c in r["prefills"]]
    qlens = [1] * r["decodes"] + [n for n, _ in r["prefills"]]
    B = -(-max(ctxs) // bs)
    kq, kt = jax.random.split(key)
    ids = jax.random.permutation(kt, k_pool.shape[0] - 1)[: len(ctxs) * B] + 1
    tables = ids.reshape(len(ctxs), B).astype(jnp.int32)
    lens = jnp.asarray(ctxs, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    T = -(-sum(qlens) // 64) * 64  # a bucket: padding rows at the end
    q = jax.random.normal(kq, (T, cfg["num_q_heads"], cfg["head_dim"]), cfg["dtype"])
    rec = dict(decodes=r["decodes"], decode_ctx=r["decode_ctx"], prefills=r["prefills"], tokens=T,
               kv_bytes=kv_bytes(cfg, sum(ctxs)))
    ragged = KERNELS[cfg["backend"]][1]
    ours = jax.jit(lambda *a: ragged(*a, interpret=interpret))
    ref = jax.jit(ragged_paged_attention_reference)
    args = (q, k_pool, v_pool, tables, lens, qsl)
    out, expect = ours(*args), ref(*args)
    rec["max_abs_err_vs_ref"] = float(jnp.abs(out.astype(jnp.float32) - expect.astype(jnp.float32)).max())
    rec["ours_s"] = timeit(ours, *args)
    rec["ours_bw"] = rec["kv_bytes"] / rec["ours_s"]
    rec["ours_frac_copy"] = rec["ours_bw"] / peak
    guarded(rec, "ref", lambda: timeit(ref, *args))
    return rec


def guarded(rec, name, fn):
    try:
        rec[f"{name}_s"] = fn()
        if "ours_s" in rec:
            rec[f"speedup_vs_{name}"] = rec[f"{name}_s"] / rec["ours_s"]
    except Exception as e:  # noqa: BLE001 - one failing peer must not stop the run
        rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def fmt(x, scale=1.0, spec=".1f"):
    return "-" if x is None else format(x * scale, spec)


def markdown(res):
    lines = [f"# Kernel benchmark ({res['env'].get('device', '?')}, jax {res['env'].get('jax', '?')})", ""]
    c = res.get("config", {})
    lines.append(f"{c.get('dtype')}, {c.get('num_q_heads')} q heads, {c.get('num_kv_heads')} kv heads, "
                 f"head_dim {c.get('head_dim')}, block_size {c.get('block_size')}. Copy bandwidth: "
                 f"{fmt(res.get('copy_peak'), 1e-9)} GB/s ({res.get('copy', {})}).")
    lines += ["", "## Decode", "",
              "| batch | context | ours us | GB/s | % of copy | JAX shipped us | vs JAX | reference us | vs ref "
              "| max err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        lines.append(f"| {r['batch']} | {r['context']} | {fmt(r.get('ours_s'), 1e6)} | {fmt(r.get('ours_bw'), 1e-9)} "
                     f"| {fmt(r.get('ours_frac_copy'), 100)} | {fmt(r.get('jax_s'), 1e6)} "
                     f"| {fmt(r.get('speedup_vs_jax'), 1, '.2f')}x | {fmt(r.get('ref_s'), 1e6)} "
                     f"| {fmt(r.get('speedup_vs_ref'), 1, '.2f')}x | {fmt(r.get('max_abs_err_vs_ref'), 1, '.1e')} |")
    lines += ["", "## Mixed prefill/decode (ragged)", "",
              "| decodes x ctx | prefill chunks (tokens, ctx) | T | ours us | GB/s | % of copy | reference us "
              "| vs ref | max err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["ragged"]:
        lines.append(f"| {r['decodes']} x {r['decode_ctx']} | {r['prefills']} | {r['tokens']} "
                     f"| {fmt(r.get('ours_s'), 1e6)} | {fmt(r.get('ours_bw'), 1e-9)} "
                     f"| {fmt(r.get('ours_frac_copy'), 100)} "
                     f"| {fmt(r.get('ref_s'), 1e6)} | {fmt(r.get('speedup_vs_ref'), 1, '.2f')}x "
                     f"| {fmt(r.get('max_abs_err_vs_ref'), 1, '.1e')} |")
    lines += ["", "## Decode tuning sweep (defaults first)", "", "| batch | context | tuning | ours us | GB/s "
              "| % of copy |", "|---|---|---|---|---|---|"]
    base = [d for d in res["decode"] if (d["batch"], d["context"]) == tuple(c.get("sweep_shape", ()))]
    for r in base + res["sweep"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['tuning']} | {fmt(r.get('ours_s'), 1e6)} "
                     f"| {fmt(r.get('ours_bw'), 1e-9)} | {fmt(r.get('ours_frac_copy'), 100)} |")
    errors = [(k, v) for r in res["decode"] + res["ragged"] for k, v in r.items() if k.endswith("_error")]
    if errors or res["errors"] or res["skipped"]:
        lines += ["", "## Errors and skips", ""] + [f"- {k}: {v}" for k, v in errors]
        lines += [f"- {e}" for e in res["errors"]] + [f"- skipped (time budget): {s}" for s in res["skipped"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in interpret mode (CI)")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds; later shapes are skipped")
    ap.add_argument("--kv-dtype", choices=["int8", "float8_e4m3fn"], default=None,
                    help="a quantized pool (decode grid only); default: the model dtype's pool")
    ap.add_argument("--backend", choices=sorted(KERNELS), default="triton",
                    help="the kernels' implementation: Pallas Triton, or Mosaic GPU (sm_90a)")
    args = ap.parse_args(argv)
    if args.backend == "mosaic" and args.cpu_smoke:
        ap.error("--backend mosaic runs on an sm_90 GPU; its interpret-mode check is "
                 "tests/test_paged_attention_mosaic_gpu.py")
    cfg = dict(SMOKE if args.cpu_smoke else GPU, kv_dtype=args.kv_dtype, backend=args.backend)
    if args.backend == "mosaic" and not args.cpu_smoke:
        cfg["sweep"] = MOSAIC_SWEEP
    interpret = args.cpu_smoke or jax.default_backend() != "gpu"
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    res = dict(env=dict(jax=jax.__version__, device=getattr(dev, "device_kind", str(dev)),
                        platform=dev.platform, interpret=interpret),
               config={k: v for k, v in cfg.items() if k not in ("ragged", "sweep")}, decode=[], ragged=[],
               sweep=[], errors=[],
               skipped=[])

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(res))

    if interpret and not args.cpu_smoke:
        res["errors"].append("no GPU: the full grid runs only on a GPU (use --cpu-smoke here)")
        save()
        return res
    start = time.perf_counter()
    try:
        res["copy"] = copy_bandwidth(cfg["copy_bytes"])
        res["copy_peak"] = max(res["copy"].values())
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"copy: {type(e).__name__}: {e}")
        res["copy_peak"] = float("nan")
    save()
    shapes = [(b, c) for b in cfg["batches"] for c in cfg["contexts"] if b * c <= cfg["max_tokens"]]
    r = cfg["ragged"]
    ragged_tokens = r["decodes"] * r["decode_ctx"] + sum(c for _, c in r["prefills"])
    blocks = max([b * c for b, c in shapes] + [ragged_tokens]) // cfg["block_size"] + 1 + 64
    key = jax.random.PRNGKey(0)
    try:
        pool = make_pool(cfg, blocks, key)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"pool of {blocks} blocks: {type(e).__name__}: {e}")
        save()
        return res
    shipped = jax_shipped_kernel() if not args.kv_dtype else None
    if shipped is None and not args.kv_dtype:
        res["errors"].append("jax.experimental.pallas.ops.gpu.paged_attention not importable")
    todo = [("decode", s) for s in shapes] if args.kv_dtype else \
        ([("ragged", None)] + [("decode", s) for s in shapes]
         + [("sweep", (*cfg["sweep_shape"], t)) for t in cfg["sweep"]])
    for i, (kind, shape) in enumerate(todo):
        if time.perf_counter() - start > args.time_budget:
            res["skipped"] += [f"{k} {s}" for k, s in todo[i:]]
            break
        try:
            sub = jax.random.fold_in(key, i)
            if kind == "ragged":
                res["ragged"].append(bench_ragged(cfg, pool, sub, interpret, res["copy_peak"]))
            elif kind == "sweep":
                b, c, t = shape
                res["sweep"].append(bench_decode(cfg, pool, b, c, sub, interpret, res["copy_peak"], None, t))
            else:
                res["decode"].append(bench_decode(cfg, pool, *shape, sub, interpret, res["copy_peak"],
                                                  shipped))
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"{kind} {shape}: {type(e).__name__}: {e}\n{traceback.format_exc()[-800:]}")
        save()
        print(f"[{time.perf_counter() - start:6.1f}s] {kind} {shape or ''} done", flush=True)
    res["wall_s"] = time.perf_counter() - start
    save()
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
