"""LoRA serving cost: the throughput workload (128 requests) spread over random rank-16 adapters on
q/k/v/o/gate/up/down, against the base model alone, side by side in one run; adapter load time; and the
batched LoRA product's two forms (one-hot matrix products vs per-token gather) timed on this machine.

    jaxpaged bench lora --json docs/results/lora.json
    jaxpaged bench lora --product-only      # the product micro-benchmark alone

vLLM's CPU build is not run here (see docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.bench import timing

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def random_adapter(path: str, model_dir: str, r: int, seed: int, std: float = 0.02) -> str:
    """Save a PEFT LoRA adapter with random A and B on every q/k/v/o/gate/up/down of the model."""
    from safetensors.numpy import save_file

    from jaxpaged.checkpoints.weights import param_shapes
    from jaxpaged.config import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    shapes = param_shapes(cfg)["layers"]
    leaf = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
            "up_proj": "w_up", "down_proj": "w_down"}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for block, mods in MODULES.items():
            for m in mods:
                d_in, d_out = shapes[leaf[m]][-2:]
                pre = f"base_model.model.model.layers.{i}.{block}.{m}"
                tensors[f"{pre}.lora_A.weight"] = (rng.standard_normal((r, d_in)) * std).astype(np.float32)
                tensors[f"{pre}.lora_B.weight"] = (rng.standard_normal((d_out, r)) * std).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=r, lora_alpha=2 * r, bias="none", use_rslora=False,
                       target_modules=[m for mods in MODULES.values() for m in mods]), f)
    return path


def bench_product(repeats: int = 20) -> dict:
    """ms per call of both forms of the batched LoRA product (SmolLM2-135M's MLP up: 576 -> 1536; 5 slots
    of rank 16; float32), for several token counts."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.lora.product import gather_delta, onehot_delta, slot_mask
    rng = np.random.default_rng(0)
    NS, R, d_in, d_out = 5, 16, 576, 1536
    a = jnp.asarray(rng.standard_normal((NS, d_in, R)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((NS, R, d_out)), jnp.float32)
    onehot = jax.jit(lambda x, idx: onehot_delta(x, a, b, slot_mask(idx, NS, R, a.dtype)))
    gather = jax.jit(lambda x, idx: gather_delta(x, a, b, idx))
    base = jax.jit(lambda x: x @ jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.float32))
    out = {}
    for T in (8, 64, 512):
        x = jnp.asarray(rng.standard_normal((T, d_in)), jnp.float32)
        idx = jnp.asarray(rng.integers(0, NS, T), jnp.int32)
        row = {}
        for name, fn, args in (("onehot", onehot, (x, idx)), ("gather", gather, (x, idx)), ("base_matmul", base, (x,))):
            row[f"{name}_ms"] = float(np.mean(timing.samples(fn, *args, reps=repeats))) * 1e3
        out[str(T)] = row
        bc.say(f"product T={T}: {row}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--product-only", action="store_true")
    bc.add_workload_args(ap, num_prompts=128, prompt_len=(32, 256), output_len=(16, 256))
    bc.add_engine_args(ap)
    args = ap.parse_args(argv)
    out = dict(product=bench_product(), machine=bc.machine_info())
    if args.product_only:
        print(json.dumps(out["product"], indent=1))
        bc.write_json(args.json, out)
        return out
    from jaxpaged import LoRARequest
    model_dir = bc.resolve_model(args.model)
    wl = bc.make_workload(args, model_dir)
    max_len = args.max_model_len or bc.workload_max_len(args)
    root = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = [LoRARequest(f"a{i}", i + 1, random_adapter(os.path.join(root, f"a{i}"), model_dir, args.rank, i))
                for i in range(args.num_adapters)]
    results = {}
    for name in ("base", "lora"):
        on = name == "lora"
        over = dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank) if on else {}
        llm = bc.build_llm(model_dir, args, max_model_len=max_len, **over)
        eng = llm.engine
        load = []
        for lr in adapters if on else ():
            t0 = time.perf_counter()
            llm.add_lora(lr)
            load.append(time.perf_counter() - t0)
        bc.warm_up(eng, eng.model_config.vocab_size)
        loras = [adapters[i % len(adapters)] for i in range(len(wl.requests))] if on else None
        bc.say(f"{name}: {len(wl.requests)} requests")
        rec = bc.drive(eng, wl.requests, loras=loras)
        results[name] = dict(bc.summarize(rec), num_compilations=eng.stats()["num_compilations"],
                             compile_seconds=eng.stats()["compile_seconds"])
        results[name].pop("per_request")
        if on:
            results[name].update(adapter_load_s=load, lora_stats={k: v for k, v in eng.stats().items()
                                                                  if k.startswith("lora_")})
        del llm, eng
        gc.collect()
    ratio = results["lora"]["output_tokens_per_s"] / results["base"]["output_tokens_per_s"]
    out.update(workload=wl.info, results=results, model=model_dir, lora_over_base_throughput=ratio,
               adapters=dict(num=args.num_adapters, rank=args.rank, targets="q/k/v/o/gate/up/down"),
               engine={k: v for k, v in bc.engine_kwargs(args, max_model_len=max_len).items() if k != "show_progress"},
               vllm="not run: vLLM's CPU build is not installed on this machine", note=bc.TIMING_NOTE)
    print(bc.table([[n, r["output_tokens_per_s"], r["elapsed_s"], r["num_compilations"]] for n, r in results.items()],
                   ["run", "output tok/s", "elapsed s", "compilations"]))
    print(f"lora / base throughput: {ratio:.3f}; adapter load s: {results['lora']['adapter_load_s']}")
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
