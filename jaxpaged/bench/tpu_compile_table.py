"""The engine's whole jitted step compiled for TPU v5e and v6e (libtpu, no TPU needed): every bucket, at
TP = 1, 4 and 8, for the default model's shapes and a Llama-3-8B-shaped config, bf16 and int8 KV.

From each compiled step: `memory_analysis()` (parameters + KV pool + temporaries per chip, against the
chip's HBM) and `cost_analysis()` (flops and HBM bytes per chip), the latter turned into a predicted decode
step time at 1, 64 and 256 running requests: max(flops / bf16 peak, bytes / HBM bandwidth) of the decode
bucket that holds them, plus the K/V those requests read at CONTEXT tokens each (the attention kernel is a
custom call, opaque to XLA's cost model, which counts its whole pool operand instead: that count is taken
out). Predictions, not measurements: scripts/tpu_check.sh measures on a TPU.

    jaxpaged bench tpu_compile_table [--out docs/results/tpu_compile.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from jaxpaged.bench import tpu_aot

MODELS = {  # Hugging Face config fields
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5),
}
ENGINE = dict(dtype="bfloat16", block_size=16, max_num_seqs=256, max_num_batched_tokens=512, max_model_len=4096)
CONTEXT = 1024  # tokens of context each running request reads in the predicted decode step
KV_TOKENS = 256 * CONTEXT  # the pool: 256 requests of CONTEXT tokens (all layers, K and V, split by KV head)
RUNNING = (1, 64, 256)
TPS = (1, 4, 8)
KV_DTYPES = ("bfloat16", "int8")
GiB = 2**30


def model_config(model: str):
    from jaxpaged.config import ModelConfig
    return ModelConfig.from_hf_dict(MODELS[model], source=model)


def kv_bytes_per_token(cfg, tp: int, kv_dtype: str) -> int:
    """Bytes one token's K and V take on each chip (all layers; scales included)."""
    from jaxpaged.step.runner import kv_bytes_per_block
    return kv_bytes_per_block(cfg, 1, ENGINE["dtype"], tp, kv_dtype)


def weight_bytes(cfg, tp: int, quantization: str | None = None) -> int:
    """Parameter bytes on each chip (bf16, or int8 / int4 codes with their scales under `quantization`;
    KV heads replicated where tp exceeds them; vocab sharded)."""
    import math

    import jax

    from jaxpaged.checkpoints.weights import empty_params
    from jaxpaged.step.mesh import leaf_specs, param_partition_specs, sharded_model_config
    shapes = empty_params(sharded_model_config(cfg, tp), "bfloat16", quantization,
                          alloc=lambda shape, dt: jax.ShapeDtypeStruct(tuple(shape), dt))
    specs = leaf_specs(param_partition_specs(cfg, tp), shapes, tp)
    sizes = jax.tree.map(lambda a, p: math.prod(a.shape) * a.dtype.itemsize // (tp if "model" in tuple(p) else 1),
                         shapes, specs)
    return sum(jax.tree.leaves(sizes))


def pool_blocks(cfg, chip: str, tp: int, kv_dtype: str, quantization: str | None = None) -> int:
    """Blocks of the pool: KV_TOKENS worth, or what is left of 90 % of the chip's HBM after the weights
    and 1 GiB of workspace (0 when nothing is left)."""
    room = 0.9 * tpu_aot.CHIPS[chip]["hbm"] - weight_bytes(cfg, tp, quantization) - GiB
    tokens = min(KV_TOKENS, int(room // kv_bytes_per_token(cfg, tp, kv_dtype)))
    return max(tokens, 0) // ENGINE["block_size"]


def predict(row: dict, cfg, chip: str, tp: int, kv_dtype: str, running: int) -> dict:
    """Decode step time at `running` requests of CONTEXT tokens: a roofline over the chip's HBM bandwidth
    and bf16 peak. Bytes: the parameters as compiled (memory_analysis' arguments less the pool) and the
    K/V the requests read; flops: 2 x parameters x the bucket's rows plus attention's 4 x rows x CONTEXT x
    heads x head_dim a layer (XLA's TPU cost analysis counts the scanned layer body once: its raw figures
    are kept beside, for the record)."""
    spec = tpu_aot.CHIPS[chip]
    params = row["argument_bytes"] - row["pool_bytes"]
    kv = running * CONTEXT * kv_bytes_per_token(cfg, tp, kv_dtype)
    heads = cfg.num_heads // tp
    flops = 2 * (params / 2) * row["T"] + 4 * running * CONTEXT * heads * cfg.head_dim * cfg.num_layers
    t_mem, t_flop = (params + kv) / spec["bandwidth"], flops / spec["peak"]
    return dict(running=running, T=row["T"], ms=1e3 * max(t_mem, t_flop), bound="HBM" if t_mem >= t_flop else "MXU",
                tokens_per_s=running / max(t_mem, t_flop))


def compile_steps(cfg, mesh, kv_dtype: str, num_blocks: int, buckets, quantization: str | None = None) -> dict:
    """{T: jax.stages.Compiled}: the engine's step for each bucket T (default: every bucket of the engine),
    over abstract parameters and pools on `mesh` (compile-only devices: nothing is allocated), attention
    from the mesh's devices (mosaic_tpu). The decode-only variants the engine also compiles are the same
    program on TPU (one ragged kernel serves both), so they are not compiled again here."""
    from jaxpaged.config import EngineConfig
    from jaxpaged.step.aot import abstract_runner
    from jaxpaged.step.aot import compile_steps as compile_variants
    ecfg = EngineConfig(**ENGINE, kv_cache_dtype=kv_dtype, attention_backend="auto", compilation_cache_dir=None,
                        tensor_parallel_size=mesh.shape["model"], quantization=quantization)
    runner = abstract_runner(cfg, ecfg, mesh, num_blocks)
    if runner.backend != "mosaic_tpu":
        raise RuntimeError(f"attention resolved to {runner.backend!r}, not mosaic_tpu, on {mesh.devices.flat[0]}")
    steps = compile_variants(runner, [(T, False) for T in buckets or runner.buckets])
    return {T: c for (T, _), c in steps.items()}


def measure(chip: str, model: str, tp: int, kv_dtype: str, buckets=None, quantization: str | None = None) -> list[dict]:
    """Rows (one per bucket) for one configuration (`quantization`: int8 / int4 weights, XLA's
    dequantize-then-dot); a configuration that cannot hold the weights, or whose step fails to compile (out
    of HBM, say), is one row that says so."""
    cfg = model_config(model)
    base = dict(chip=chip, model=model, tp=tp, kv_dtype=kv_dtype, quantization=quantization,
                weight_bytes=weight_bytes(cfg, tp, quantization))
    nb = pool_blocks(cfg, chip, tp, kv_dtype, quantization)
    if nb == 0:
        return [dict(base, error="the weights leave no room for a KV pool")]
    mesh = tpu_aot.topology_mesh(chip, tp)
    t0, first_error = time.perf_counter(), None
    for blocks in (nb, nb // 8):  # out of HBM: the row says so, and the step is measured on a pool 1/8 the size
        try:
            steps = compile_steps(cfg, mesh, kv_dtype, blocks, buckets, quantization)
            break
        except Exception as e:  # noqa: BLE001 -- recorded: the configuration does not compile
            msg = str(e).strip().splitlines()[0][:300]
            if first_error or "RESOURCE_EXHAUSTED" not in msg:
                return [dict(base, pool_tokens=blocks * ENGINE["block_size"], error=msg, full_pool_error=first_error)]
            first_error, t0 = f"pool of {blocks * ENGINE['block_size']} tokens: {msg}", time.perf_counter()
    nb = blocks
    pool = nb * ENGINE["block_size"] * kv_bytes_per_token(cfg, tp, kv_dtype)
    seconds = (time.perf_counter() - t0) / len(steps)
    rows = []
    for T, c in sorted(steps.items()):
        m, ca = c.memory_analysis(), c.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        row = dict(base, T=T, pool_tokens=nb * ENGINE["block_size"], pool_bytes=pool, full_pool_error=first_error,
                   argument_bytes=m.argument_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                   total_bytes=total, fits=total <= tpu_aot.CHIPS[chip]["hbm"], compile_s=seconds,
                   mosaic_kernels=c.as_text().count('custom_call_target="tpu_custom_call"'),
                   pool_copies=tpu_aot.pool_copies(c, pool // 4),  # a K or V pool (all layers) relaid out
                   xla_flops=ca.get("flops"), xla_bytes=ca.get("bytes accessed"))
        rows.append(row)
    for r in rows:  # each decode prediction from the smallest bucket holding its requests; none where the
        # pool is relayouted on every call (head_dim 64: its cost is not in the roofline)
        r["predicted"] = [predict(r, cfg, chip, tp, kv_dtype, n) for n in RUNNING
                          if r["T"] == min([x["T"] for x in rows if x["T"] >= n] or [None]) and not r["pool_copies"]]
    return rows


def table(rows) -> str:
    """The markdown table of docs/kernels.md and docs/scale-out.md: one line per configuration."""
    out = ["| chip | model | TP | KV | pool (tokens) | HBM per chip: weights + KV + temp = total | fits | "
           "buckets | s / bucket | pool copies | predicted decode ms (tok/s) at 1 / 64 / 256 running |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["chip"], r["model"], r["tp"], r["kv_dtype"]) for r in rows},
                  key=lambda k: (k[1], k[0], k[2], k[3]))
    for key in keys:
        rs = [r for r in rows if (r["chip"], r["model"], r["tp"], r["kv_dtype"]) == key]
        head = f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} |"
        if "error" in rs[0]:
            out.append(f"{head} {rs[0].get('pool_tokens', 0)} | {rs[0]['weight_bytes'] / GiB:.2f} GiB of weights: "
                       f"{rs[0]['error'][:90]} | no | | | | |")
            continue
        big = max(rs, key=lambda r: r["total_bytes"])
        pred = {p["running"]: p for r in sorted(rs, key=lambda r: -r["T"]) for p in r["predicted"]}  # smallest T wins
        cell = " / ".join(f"{pred[n]['ms']:.2f} ({pred[n]['tokens_per_s']:.0f})" if n in pred else "—" for n in RUNNING)
        full = (big["full_pool_error"].split(":")[0].replace("pool of ", "") + ": out of HBM; then "
                if big.get("full_pool_error") else "")
        out.append(f"{head} {full}{big['pool_tokens']} | {(big['argument_bytes'] - big['pool_bytes']) / GiB:.2f} + "
                   f"{big['pool_bytes'] / GiB:.2f} + {big['temp_bytes'] / GiB:.2f} = "
                   f"{big['total_bytes'] / GiB:.2f} GiB | "
                   f"{'yes' if all(r['fits'] for r in rs) else 'no'} | {len(rs)} | {rs[0]['compile_s']:.0f} | "
                   f"{max(r['pool_copies'] for r in rs)} | {cell} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/tpu_compile.json")
    ap.add_argument("--chip", action="append", choices=sorted(tpu_aot.CHIPS))
    ap.add_argument("--model", action="append", choices=sorted(MODELS))
    ap.add_argument("--tp", action="append", type=int, choices=TPS)
    ap.add_argument("--kv-dtype", action="append", choices=KV_DTYPES)
    ap.add_argument("--buckets", type=int, nargs="*", default=None, help="default: every bucket of the engine")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no compiling: merge these outputs into --out")
    args = ap.parse_args(argv)
    if args.merge:
        runs = [json.load(open(p)) for p in args.merge]
        rows = [r for run in runs for r in run["rows"]]
        with open(args.out, "w") as f:
            json.dump({**runs[0], "rows": rows}, f, indent=1)
        print(table(rows))
        return
    configs = [(c, m, t, k) for m in args.model or sorted(MODELS) for c in args.chip or sorted(tpu_aot.CHIPS)
               for t in args.tp or TPS for k in args.kv_dtype or KV_DTYPES]
    rows = []
    for chip, model, tp, kv in configs:  # one process each: libtpu and the compile caches start clean
        code = (f"import json; from jaxpaged.bench import tpu_compile_table as t; "
                f"print('ROWS' + json.dumps(t.measure({chip!r}, {model!r}, {tp}, {kv!r}, {args.buckets!r})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **tpu_aot.environment()})
        line = [x for x in res.stdout.splitlines() if x.startswith("ROWS")]
        rows += json.loads(line[0][4:]) if line else [dict(chip=chip, model=model, tp=tp, kv_dtype=kv, weight_bytes=0,
                                                           error="compile process failed: " + res.stderr[-200:])]
        print(f"{chip} {model} TP={tp} {kv}: {len(rows)} rows", file=sys.stderr, flush=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(engine=ENGINE, context=CONTEXT, chips=tpu_aot.CHIPS, rows=rows), f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
