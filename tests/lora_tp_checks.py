"""LoRA under tensor parallelism on simulated CPU devices, run by tests/test_lora_tp.py in a subprocess.

`python tests/lora_tp_checks.py BASE ADAPTER1 ADAPTER2` (XLA_FLAGS must already hold
--xla_force_host_platform_device_count=4) prints one JSON object on its last line: per TP size, every
request's greedy tokens and their logprobs, the number of compilations, and the slot arrays' shard shapes.
"""
from __future__ import annotations

import json
import sys

import jax
import numpy as np

TPS = (1, 2, 4)


def main(base: str, *adapters: str) -> None:
    from jaxpaged import LLM, LoRARequest, SamplingParams
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, 256, size=n)] for n in (5, 19, 9, 12, 3)]
    loras = [None, 1, 2, 1, 2]
    reqs = {i + 1: LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)}
    out = {"num_devices": len(jax.devices())}
    for tp in TPS:
        llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", tensor_parallel_size=tp,
                  block_size=8, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                  compilation_cache_dir=None, show_progress=False, attention_backend="reference")
        sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                           lora_request=[reqs[i] if i else None for i in loras])
        slots = llm.engine.runner.lora.arrays
        out[str(tp)] = dict(
            tokens=[list(r.outputs[0].token_ids) for r in res],
            logprobs=[[lp[t] for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)] for r in res],
            num_compilations=llm.stats()["num_compilations"], num_buckets=llm.stats()["num_buckets"],
            shards={f"{w}/{t}": list(a.addressable_shards[0].data.shape) for w in ("a", "b")
                    for t, a in slots[w].items()})
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
