"""Tensor-parallel correctness: greedy tokens (float32) at TP=N equal TP=1 on a mixed workload.

    jaxpaged bench tp_check --tensor-parallel-size 2 [--model DIR | random:PRESET] [--json PATH]

Runs on GPUs, or on simulated CPU devices (the flag is set here when no device count is forced).
Prints one JSON line and exits 1 when any request's tokens differ.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.config import ATTENTION_BACKENDS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--model", default="random:llama-8h")
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    tp = args.tensor_parallel_size
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # before JAX starts; CPU only
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={tp}".strip()
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.config import ModelConfig
    model_dir = bc.resolve_model(args.model)
    V = ModelConfig.from_dir(model_dir).vocab_size
    rng = np.random.default_rng(0)
    shared = rng.integers(3, V, 48).tolist()
    prompts = [rng.integers(3, V, n).tolist() for n in (5, 40, 130, 17)]
    prompts += [shared + rng.integers(3, V, n).tolist() for n in (3, 30)]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    out = dict(model=model_dir, tensor_parallel_size=tp)
    tokens = {}
    for n in (1, tp):
        t0 = time.perf_counter()
        llm = LLM(model=model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                  attention_backend=args.attention_backend, tensor_parallel_size=n, show_progress=False)
        tokens[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        s = llm.stats()
        out[f"tp{n}"] = dict(seconds=round(time.perf_counter() - t0, 1), backend=s["attention_backend"],
                             param_bytes_per_device=s["param_bytes_per_device"],
                             kv_bytes_per_device=s["kv_bytes_per_device"], num_kv_blocks=s["kv_blocks_total"] + 1)
        del llm
    out["mismatched_requests"] = [i for i, (a, b) in enumerate(zip(tokens[1], tokens[tp])) if a != b]
    out["ok"] = not out["mismatched_requests"]
    print(json.dumps(out))
    bc.write_json(args.json, out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
