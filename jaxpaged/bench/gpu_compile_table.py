"""The sm_90a compile table: every attention-kernel configuration the engine compiles for the default model
and the Llama-3-8B / 70B shapes, both backends, bf16 / fp8 / int8 KV; and the engine's whole jitted step
(all buckets) for a Llama-3-8B-shaped config at TP=1 and TP=8 (and Llama-3-70B at TP=8), with
memory_analysis() and a roofline-predicted H200 step time for decode at 1 / 64 / 256 running.

Everything compiles on this CPU-only machine (jaxpaged/bench/gpu_compile.py). Writes docs/results/compile_sm90.json
and prints the markdown tables docs/kernels.md quotes.

    jaxpaged bench gpu_compile_table [--out docs/results/compile_sm90.json] [--only kernels|steps]
"""
from __future__ import annotations

import argparse
import json
import os
import time

from jaxpaged.bench import gpu_compile
from jaxpaged.bench.gpu_compile import H200

# (label, q heads, kv heads, head_dim) as one device's kernel sees them
SHAPES = [("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128), ("Llama-3-70B", 64, 8, 128),
          ("Llama-3-70B / TP=8 (per device)", 8, 1, 128)]
KV = ("bfloat16", "float8_e4m3fn", "int8")
# the engine's kernel shapes: 256 slots, 4096-token contexts (256 blocks of 16), a 512-token ragged bucket
ENGINE = dict(block_size=16, slots=256, max_blocks=256, num_blocks=32768, tokens=512)
# whole steps: 256 slots, 512-token buckets, 4096-token model length; a pool of 16384 blocks a layer (262k
# tokens); decode predicted at 1 / 64 / 256 running requests of CONTEXT tokens each (buckets 8 / 64 / 256)
STEP = dict(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=4096, num_blocks=16384)
RUNNING = {8: 1, 64: 64, 256: 256}  # decode-only bucket T -> running requests predicted in it
CONTEXT = 1024
DECODE_COSTS = [[t, True] for t in RUNNING]
STEP_CONFIGS = [
    dict(STEP, config="Llama-3-8B, bf16 KV", size="8B", tp=1, kv_cache_dtype="auto", cost_variants=DECODE_COSTS),
    dict(STEP, config="Llama-3-8B, bf16 KV", size="8B", tp=8, kv_cache_dtype="auto", cost_variants=DECODE_COSTS),
    dict(STEP, config="Llama-3-8B, fp8 KV", size="8B", tp=1, kv_cache_dtype="float8_e4m3fn", variants=DECODE_COSTS,
         cost_variants=DECODE_COSTS),
    dict(STEP, config="Llama-3-70B, bf16 KV", size="70B", tp=8, kv_cache_dtype="auto", variants=DECODE_COSTS,
         cost_variants=DECODE_COSTS)]
SIZES = {"8B": dict(kv_heads=8, head_dim=128), "70B": dict(kv_heads=8, head_dim=128)}


def kernel_cases() -> list[dict]:
    return [dict(ENGINE, model=label, hq=hq, hkv=hkv, head_dim=hd, kv=kv, backend=b, kernel=k)
            for label, hq, hkv, hd in SHAPES for kv in KV for k in ("decode", "ragged") for b in ("triton", "mosaic")]


def kernel_table(rows: list[dict]) -> str:
    out = ["| model (q/kv heads x head_dim) | kernel | KV | backend | registers | spills (B) | smem (KB) | compile s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        spills = r["spill_store_bytes"] + r["spill_load_bytes"]
        out.append(f"| {r['model']} ({r['hq']}/{r['hkv']}x{r['head_dim']}) | {r['kernel']} | {r['kv']} | "
                   f"{r['backend']} | {r['registers']} | {spills} | {r.get('smem_bytes', 0) / 1024:.1f} | "
                   f"{r['compile_s']} |")
    return "\n".join(out)


def _kv_token_bytes(step: dict) -> float:
    """Bytes of K and V (scales included) of one token, one layer, on one device."""
    m = SIZES[step["size"]]
    per_elem = 2 if step["kv_cache_dtype"] == "auto" else 1
    scales = 0 if step["kv_cache_dtype"] == "auto" else 4
    return 2 * max(m["kv_heads"] // step["tp"], 1) * (m["head_dim"] * per_elem + scales)


def kv_bytes_read(step: dict, running: int) -> float:
    """K/V bytes one device reads in a decode step of `running` requests of CONTEXT tokens, every layer."""
    return running * CONTEXT * step["layers"] * _kv_token_bytes(step)


def pool_bytes(step: dict) -> float:
    """The KV pools' bytes on one device (every layer's blocks)."""
    return step["layers"] * step["num_blocks"] * 16 * _kv_token_bytes(step)


def attention_flops(step: dict, running: int) -> float:
    """The attention kernels' flops on one device (q k^T and p v; XLA counts none inside a custom call)."""
    m = SIZES[step["size"]]
    q_heads = {"8B": 32, "70B": 64}[step["size"]] // step["tp"]
    return 4.0 * running * CONTEXT * q_heads * m["head_dim"] * step["layers"]


def all_steps() -> list[dict]:
    """Every STEP_CONFIGS step compiled (one subprocess per config), with running counts and KV bytes for
    the decode variants that carry costs."""
    rows = []
    for c in STEP_CONFIGS:
        for r in gpu_compile.run("steps", dict(configs=[c]), timeout=5400):
            r["fits_h200"] = r["argument_bytes"] + r["temp_bytes"] <= H200["hbm_bytes"]
            if "flops" in r:
                r["running"], r["context"] = RUNNING[r["tokens"]], CONTEXT
                r["kv_bytes_read"] = kv_bytes_read(r, r["running"])
                r["pool_bytes"] = pool_bytes(r)
                r["attention_flops"] = attention_flops(r, r["running"])
            rows.append(r)
    return rows


def predict(step: dict) -> dict:
    """Roofline step time on an H200 (one device): flops at 989 TFLOP/s (bf16) against bytes at 4.8 TB/s.

    flops: XLA's HLO cost analysis of the fully unrolled step (matmuls, norms, sampler) plus the attention
    kernels' (custom calls count none). bytes: what a decode step must read, the device's parameters
    (memory_analysis()'s arguments less the KV pools) and the running requests' K/V; XLA's own byte count
    is kept beside it but over-counts here: it charges the pools in full to every in-place KV write and
    every kernel call."""
    flops = step["flops"] + step["attention_flops"]
    bytes_ = step["argument_bytes"] - step["pool_bytes"] + step["kv_bytes_read"]
    t_flops, t_bytes = flops / H200["bf16_flops_per_s"], bytes_ / H200["hbm_bytes_per_s"]
    return dict(predicted_ms=1e3 * max(t_flops, t_bytes), bound="memory" if t_bytes >= t_flops else "compute",
                predicted_flops=flops, predicted_bytes=bytes_, tokens_per_s=step["running"] / max(t_flops, t_bytes))


def step_table(rows: list[dict]) -> str:
    out = ["| config | TP | step (T, decode-only) | running | args GB/dev | temp GB/dev | fits H200 | GFLOP | "
           "GB moved | predicted ms | bound | tok/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        p = r.get("prediction") or {}
        nan = float("nan")
        out.append(f"| {r['config']} | {r['tp']} | {r['tokens']}, {r['decode_only']} | {r.get('running', '')} | "
                   f"{r['argument_bytes'] / 1e9:.1f} | {r['temp_bytes'] / 1e9:.2f} | {r['fits_h200']} | "
                   f"{p.get('predicted_flops', nan) / 1e9:.1f} | {p.get('predicted_bytes', nan) / 1e9:.2f} | "
                   f"{p.get('predicted_ms', nan):.2f} | {p.get('bound', '')} | {p.get('tokens_per_s', nan):.0f} |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/compile_sm90.json",
                    help="the JSON written (updated in place: --only keeps the other part)")
    ap.add_argument("--only", choices=["kernels", "steps"], default=None)
    args = ap.parse_args(argv)
    reason = gpu_compile.missing()
    if reason:
        raise SystemExit(f"cannot compile for sm_90a here: {reason}")
    res = json.load(open(args.out)) if os.path.exists(args.out) else {}
    res["target"] = "sm_90a (XLA's h100_sxm spec); predictions for an H200: 4.8 TB/s, 989 TFLOP/s bf16, 141 GB"
    if args.only in (None, "kernels"):
        t0 = time.perf_counter()
        res["kernels"] = gpu_compile.run("kernels", dict(cases=kernel_cases()), timeout=3600)
        res["kernels_seconds"] = round(time.perf_counter() - t0, 1)
        print(kernel_table(res["kernels"]))
    if args.only in (None, "steps"):
        t0 = time.perf_counter()
        res["steps"] = all_steps()
        for r in res["steps"]:
            if r.get("running"):
                r["prediction"] = predict(r)
        res["steps_seconds"] = round(time.perf_counter() - t0, 1)
        print(step_table(res["steps"]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
