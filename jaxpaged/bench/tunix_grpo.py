"""A few GRPO steps of Tunix (`GRPOLearner` over an `RLCluster`) on a tiny random Tunix model, once rolling out
through JaxpagedRollout and once through Tunix's vanilla sampler: each step's mean reward and rollout time.

    jaxpaged bench tunix_grpo [--steps 4] [--prompts 8] [--samples 4] [--gen 32] [--family llama3|qwen3]

Both runs start from the same weights and train with the same optimizer on one device, float32; the toy reward
is the number of distinct characters of a completion (the tiny model's vocabulary is a few hundred pieces of
English). Sampling draws differ between the two samplers, so the rewards are two samples of the same
process, not equal numbers. `setup_seconds` is the RLCluster's construction (jaxpaged compiles its step
buckets there); the first rollout of each run may compile too; `rollout_seconds_after_first` sums the others.
Tunix's trainer runs the same in both, and its time is not counted.
"""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time


def run(engine: str, args, tok, prompts) -> dict:
    """One GRPO run rolling out through `engine` ("jaxpaged" or "vanilla"): rewards and rollout times per step."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner as grpo
    from tunix.rl.rollout import base_rollout

    from jaxpaged.rl.tunix_rollout import JaxpagedRollout
    sizes = dict(num_layers=2, vocab_size=320, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                 num_kv_heads=2, rope_theta=10000, norm_eps=1e-6)
    mod, cls = (llama3, llama3.Llama3) if args.family == "llama3" else (qwen3, qwen3.Qwen3)
    model = cls(mod.ModelConfig(**sizes), rngs=nnx.Rngs(0))
    # Tunix's models shard with the mesh's axes in Auto mode
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1], axis_types=(AxisType.Auto,) * 2)
    n = args.prompts * args.samples
    rollout_engine = "vanilla" if engine == "vanilla" else functools.partial(
        JaxpagedRollout, max_num_seqs=min(n, 256), max_num_batched_tokens=1024, block_size=16)
    # an int seed: the vanilla sampler makes a fresh key of it each call (it donates the key it is given)
    rc = base_rollout.RolloutConfig(max_tokens_to_generate=args.gen, max_prompt_length=16, temperature=1.0,
                                    seed=0, kv_cache_size=32 + args.gen)
    config = rl.ClusterConfig(
        role_to_mesh={r: mesh for r in (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)},
        rollout_engine=rollout_engine,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adam(args.lr), eval_every_n_steps=10**9,
                                            max_steps=args.steps),
        rollout_config=rc)
    t0 = time.perf_counter()
    cluster = rl.RLCluster(actor=model, tokenizer=tok, cluster_config=config)
    setup = time.perf_counter() - t0
    rewards, seconds = [], []

    def reward(prompts, completions, **_):
        r = [float(len(set(c))) for c in completions]
        rewards.append(float(np.mean(r)))
        return r

    rollout, generate = cluster.rollout, cluster.rollout.generate

    def timed_generate(prompts, rollout_config, **kwargs):
        t0 = time.perf_counter()
        out = generate(prompts, rollout_config, **kwargs)
        jax.block_until_ready(out.tokens)
        seconds.append(time.perf_counter() - t0)
        return out

    rollout.generate = timed_generate  # the cluster calls the rollout it holds
    learner = grpo.GRPOLearner(cluster, grpo.GRPOConfig(num_generations=args.samples, beta=0.0), reward_fns=reward)
    learner.train([{"prompts": np.array(prompts[i * args.prompts:(i + 1) * args.prompts])}
                   for i in range(args.steps)])
    out = {"setup_seconds": round(setup, 3), "mean_reward_per_step": [round(r, 3) for r in rewards],
           "rollout_seconds": [round(s, 3) for s in seconds],
           "rollout_seconds_after_first": round(sum(seconds[1:]), 3)}
    if engine == "jaxpaged":
        stats = rollout.engine.stats()
        out["kv_blocks_free_at_end"] = stats["kv_blocks_free"]
        out["kv_blocks_total"] = stats["kv_blocks_total"]
        out["num_compilations"] = stats["num_compilations"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="GRPO's G: completions per prompt")
    ap.add_argument("--gen", type=int, default=32, help="max tokens per completion")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--family", choices=["llama3", "qwen3"], default="llama3")
    ap.add_argument("--engines", nargs="+", choices=["jaxpaged", "vanilla"], default=["jaxpaged", "vanilla"])
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from jaxpaged.testing.tiny_models import CORPUS, add_tiny_tokenizer
    d = tempfile.mkdtemp()
    add_tiny_tokenizer(d)
    tok = AutoTokenizer.from_pretrained(d)
    words = CORPUS.split()
    prompts = [" ".join(words[(7 * i) % 40:(7 * i) % 40 + 4]) for i in range(args.steps * args.prompts)]
    result = {k: getattr(args, k) for k in ("steps", "prompts", "samples", "gen", "lr", "family")}
    for engine in args.engines:
        result[engine] = run(engine, args, tok, prompts)
    if {"jaxpaged", "vanilla"} <= set(result) and args.steps > 1:
        j, v = result["jaxpaged"]["rollout_seconds_after_first"], result["vanilla"]["rollout_seconds_after_first"]
        result["rollout_speedup_after_first"] = round(v / j, 2) if j else None
    print(json.dumps(result, indent=1))
    return result
