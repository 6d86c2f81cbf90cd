"""The sm_90a compile table: every attention-kernel configuration the engine compiles for the default model
and the Llama-3-8B / 70B shapes, both backends, bf16 / fp8 / int8 KV; and the engine's whole jitted step
(all buckets) for a Llama-3-8B-shaped config at TP=1 and TP=8 (and Llama-3-70B at TP=8), with
memory_analysis() and a roofline-predicted H200 step time for decode at 1 / 64 / 256 running.

Everything compiles on this CPU-only machine (scripts/gpu_compile.py). Writes docs/results/compile_sm90.json
and prints the markdown tables docs/kernels.md quotes.

    python scripts/compile_table.py [--out docs/results/compile_sm90.json] [--only kernels|steps]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_compile  # noqa: E402
from gpu_compile import H200  # noqa: E402

# (label, q heads, kv heads, head_dim) as one device's kernel sees them
SHAPES = [("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128), ("Llama-3-70B", 64, 8, 128),
          ("Llama-3-70B / TP=8 (per device)", 8, 1, 128)]
KV = ("bfloat16", "float8_e4m3fn", "int8")
# the engine's kernel shapes: 256 slots, 4096-token contexts (256 blocks of 16), a 512-token ragged bucket
ENGINE = dict(block_size=16, slots=256, max_blocks=256, num_blocks=32768, tokens=512)


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


def predict(step: dict) -> dict:
    """Roofline step time on an H200 from one compiled step's HLO cost: flops at 989 TFLOP/s (bf16) against
    bytes at 4.8 TB/s, where the attention kernels' bytes are what they read (the running requests' K/V),
    not their whole operands (XLA's cost analysis counts a custom call's operands in full)."""
    flops = step["flops"]
    bytes_ = step["bytes_accessed"] - step["kernel_operand_bytes"] + step["kv_bytes_read"]
    t_flops, t_bytes = flops / H200["bf16_flops_per_s"], bytes_ / H200["hbm_bytes_per_s"]
    return dict(predicted_ms=1e3 * max(t_flops, t_bytes), bound="memory" if t_bytes >= t_flops else "compute",
                predicted_bytes=bytes_, tokens_per_s=step["running"] / max(t_flops, t_bytes))


def step_table(rows: list[dict]) -> str:
    out = ["| config | TP | step (T, decode-only) | running | args GB/dev | temp GB/dev | fits H200 | GFLOP | "
           "GB moved | predicted ms | bound | tok/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        p = r.get("prediction") or {}
        out.append(f"| {r['config']} | {r['tp']} | {r['tokens']}, {r['decode_only']} | {r.get('running', '')} | "
                   f"{r['argument_bytes'] / 1e9:.1f} | {r['temp_bytes'] / 1e9:.2f} | {r['fits_h200']} | "
                   f"{r['flops'] / 1e9:.1f} | {p.get('predicted_bytes', r['bytes_accessed']) / 1e9:.2f} | "
                   f"{p.get('predicted_ms', float('nan')):.2f} | {p.get('bound', '')} | "
                   f"{p.get('tokens_per_s', float('nan')):.0f} |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(gpu_compile.ROOT, "docs", "results", "compile_sm90.json"))
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
        import compile_steps
        t0 = time.perf_counter()
        res["steps"] = compile_steps.all_steps()
        for r in res["steps"]:
            if r.get("running"):
                r["prediction"] = predict(r)
        res["steps_seconds"] = round(time.perf_counter() - t0, 1)
        print(step_table(res["steps"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
