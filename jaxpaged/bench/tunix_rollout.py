"""The rollout phase of one GRPO step on a tiny random Tunix model: JaxpagedRollout against Tunix's vanilla
sampler on the same model and prompts (P prompts x G samples each), time and generated tokens/s side by
side, each timed on its second call (the first compiles).

    jaxpaged bench tunix_rollout [--prompts 64] [--samples 4] [--gen 32] [--family llama3|qwen3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--family", choices=["llama3", "qwen3"], default="llama3")
    args = ap.parse_args(argv)
    import jax
    from flax import nnx
    from transformers import AutoTokenizer
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl.rollout import base_rollout
    from tunix.rl.rollout.vanilla_rollout import VanillaRollout

    from jaxpaged.rl.tunix_rollout import JaxpagedRollout
    from jaxpaged.testing.tiny_models import CORPUS, add_tiny_tokenizer
    sizes = dict(num_layers=2, vocab_size=320, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                 num_kv_heads=2, rope_theta=10000, norm_eps=1e-6)
    mod, cls = (llama3, llama3.Llama3) if args.family == "llama3" else (qwen3, qwen3.Qwen3)
    model = cls(mod.ModelConfig(**sizes), rngs=nnx.Rngs(0))
    d = tempfile.mkdtemp()
    add_tiny_tokenizer(d)
    tok = AutoTokenizer.from_pretrained(d)
    words = CORPUS.split()
    prompts = [" ".join(words[i % 40:i % 40 + 4]) for i in range(args.prompts) for _ in range(args.samples)]
    # a fresh seed key per call: Tunix's sampler donates the one it is given
    config = lambda: base_rollout.RolloutConfig(max_tokens_to_generate=args.gen, max_prompt_length=16,
                                                temperature=1.0, seed=jax.random.PRNGKey(0),
                                                kv_cache_size=32 + args.gen)
    rc = config()
    c = model.config
    engines = {
        "jaxpaged": JaxpagedRollout(model, tok, rollout_config=rc, max_num_seqs=min(len(prompts), 256),
                                    max_num_batched_tokens=1024, block_size=16),
        "vanilla": VanillaRollout(model, tok, base_rollout.CacheConfig(32 + args.gen, c.num_layers,
                                                                       c.num_kv_heads, c.head_dim)),
    }
    result = {"prompts": args.prompts, "samples": args.samples, "gen": args.gen, "family": args.family}
    for name, eng in engines.items():
        eng.generate(prompts, config())  # compiles
        t0 = time.perf_counter()
        out = eng.generate(prompts, config())
        dt = time.perf_counter() - t0
        n = sum(len(t) for t in out.tokens)
        result[name] = {"seconds": round(dt, 3), "tokens": n, "tokens_per_s": round(n / dt, 1)}
    result["speedup_tokens_per_s"] = round(result["jaxpaged"]["tokens_per_s"] / result["vanilla"]["tokens_per_s"], 2)
    print(json.dumps(result, indent=1))
    return result
