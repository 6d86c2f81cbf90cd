"""Issue 13's figures: compile time per bucket of each family, decode throughput of a ~100M-parameter
random MoE against a dense model with the same active parameters, and the KV blocks a sliding window frees.

    jaxpaged bench families [compile] [moe] [window] [--json PATH]

compile: tiny random models of every family (jaxpaged/testing/tiny_models.py), every bucket of a 64-token budget
  compiled without the persistent cache; seconds per bucket.
moe: Mixtral-shaped (8 experts, top-2) vs Mistral-shaped dense with intermediate = 2 x the experts', same
  attention and embeddings; 16 requests decoding 64 tokens each at batch 16; generation timed after a
  warm-up run, the ratio is what to read.
window: host only (block manager + scheduler, no model): requests of a Mistral-7B-like window (4096
  tokens, blocks of 16, budget 512), peak blocks held with and without freeing the blocks behind windows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def bench_compile() -> dict:
    from jaxpaged import LLM, ModelConfig
    from jaxpaged.testing.tiny_models import NEW_FAMILIES, make_tiny_model
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for f in ("llama",) + NEW_FAMILIES:
            path = make_tiny_model(os.path.join(d, f), f)
            llm = LLM(model=path, dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
                      max_model_len=256, compilation_cache_dir=None, show_progress=False)
            r = llm.engine.runner
            cfg = ModelConfig.from_dir(path)
            out[f] = dict(layers=cfg.num_layers, layer_period=cfg.layer_period, buckets=r.buckets,
                          seconds_per_bucket=round(r.compile_seconds / r.num_compilations, 2))
            print(f, out[f], file=sys.stderr, flush=True)
    return out


def _save(cfg, path):
    import torch
    import transformers as tf
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def bench_moe() -> dict:
    import numpy as np
    import transformers as tf

    from jaxpaged import LLM, SamplingParams
    common = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=1024, sliding_window=None)
    F, E, k = 768, 8, 2
    out = {}
    with tempfile.TemporaryDirectory() as d:
        models = {"moe": tf.MixtralConfig(**common, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k),
                  "dense": tf.MistralConfig(**common, intermediate_size=k * F)}
        for name, cfg in models.items():
            path = os.path.join(d, name)
            _save(cfg, path)
            llm = LLM(model=path, dtype="float32", max_num_seqs=16, max_num_batched_tokens=256,
                      max_model_len=512, show_progress=False)
            params = llm.engine.runner.params
            import jax
            total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
            rng = np.random.default_rng(0)
            prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 8192, size=16)]} for _ in range(16)]
            sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
            llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            out[name] = dict(params_total=total, decode_tok_s=round(16 * 64 / dt, 1))
            print(name, out[name], file=sys.stderr, flush=True)
    out["moe_over_dense"] = round(out["moe"]["decode_tok_s"] / out["dense"]["decode_tok_s"], 3)
    return out


def bench_window(window=4096, bs=16, budget=512, prompt=16384, new=512, n=8) -> dict:
    import random

    from jaxpaged.core.block_manager import BlockManager
    from jaxpaged.core.request import Request
    from jaxpaged.core.sampling_params import SamplingParams
    from jaxpaged.core.scheduler import Scheduler
    from jaxpaged.core.step_result import Sampled, StepResult
    out = {}
    for name, w in (("without_freeing", None), ("with_freeing", window)):
        bm = BlockManager(10 ** 6, bs, enable_prefix_caching=True, sliding_window=w)
        sched = Scheduler(bm, max_num_seqs=n, max_num_batched_tokens=budget)
        rnd = random.Random(0)
        for i in range(n):
            sched.add(Request(f"r{i}", f"r{i}", 0, [rnd.randrange(32000) for _ in range(prompt)],
                              SamplingParams(max_tokens=new), seed=i))
        peak, done = 0, 0
        while done < n:
            o = sched.schedule()
            peak = max(peak, bm.num_used_blocks)
            for r in sched.update_from_output(o, StepResult({r.slot: Sampled([1], None) for r, _ in o.scheduled})):
                if r.num_output_tokens >= new:
                    sched.finish(r, "length")
                    done += 1
        out[name] = dict(peak_blocks=peak)
    out["setting"] = dict(window=window, block_size=bs, budget=budget, requests=n, prompt=prompt, new=new)
    out["saved_fraction"] = round(1 - out["with_freeing"]["peak_blocks"] / out["without_freeing"]["peak_blocks"], 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="*", default=["compile", "moe", "window"], choices=["compile", "moe", "window"])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    res = {w: {"compile": bench_compile, "moe": bench_moe, "window": bench_window}[w]() for w in args.what}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
