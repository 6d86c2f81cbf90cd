"""Decode step time by kv_cache_dtype, A/B in one run: device time of the same decode step per KV dtype.

    jaxpaged bench kv_cache --running 128 --kv auto int8 --rounds 7 --json results/kv_cache.json

For each KV dtype an engine (max_num_seqs = N) is filled with the same N requests (seeded random prompts of
--context tokens) until all of them decode, and its next decode step is captured (bench_host's capture).
Then --rounds rounds replay every engine's captured step --replays times, the engines interleaved within
each round (A, B, A, B, ...), so both see the same machine load; the report is the median device time per
step, tokens/s (N / step time) and the ratio of each dtype's tokens/s to the first one's.

--attention: instead, the reference attention of one layer alone (jitted, the decode step's shapes: N
slots of --context + 3 keys, the model's heads, a pool of every layer's blocks, random block ids), one
call per dtype in turn for --rounds x --replays calls; median and min ms per layer call.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.bench import timing
from jaxpaged.bench.host import capture_next_step, replay


def filled_engine(model_dir: str, args, kv: str, N: int):
    """An engine of N decoding requests; returns (engine, captured decode step)."""
    from jaxpaged import SamplingParams
    budget = max(2 * N, args.max_num_batched_tokens)
    max_len = args.context + 64
    per_seq = -(-max_len // args.block_size)
    llm = bc.build_llm(model_dir, args, kv_cache_dtype=kv, max_num_seqs=N, max_num_batched_tokens=budget,
                       max_model_len=max_len, num_kv_blocks=N * per_seq + 1, warmup=False)
    eng = llm.engine
    rng = np.random.default_rng(args.seed)
    sp = SamplingParams(max_tokens=max_len - args.context, temperature=0.0, ignore_eos=True)
    for i in range(N):
        eng.add_request(f"r{i}", [int(t) for t in rng.integers(3, eng.model_config.vocab_size, args.context)], sp)
    sch = eng.scheduler
    while sch.waiting or any(r.num_computed_tokens < len(r.token_ids) - 1 for r in sch.running):
        eng.step()
    eng.step()
    captured = capture_next_step(eng.runner)
    eng.step()
    eng.runner.wrap_steps(None)
    return eng, captured


def attention_times(model_dir: str, args, N: int) -> list[dict]:
    """Milliseconds of one layer's reference attention at the decode step's shapes, per KV dtype."""

    import jax
    import jax.numpy as jnp

    from jaxpaged.config import ModelConfig
    from jaxpaged.step import kv_cache
    from pallas_kernels.attention.reference import ragged_paged_attention_reference as attend
    mc, bs, ctx = ModelConfig.from_dir(model_dir), args.block_size, args.context + 3
    B = -(-(args.context + 64) // bs)
    n_blocks = mc.num_layers * (N * B + 1)
    rng = np.random.default_rng(args.seed)
    kf = jnp.asarray(rng.standard_normal((n_blocks, bs, mc.num_kv_heads, mc.head_dim)), jnp.float32)
    vf = jnp.asarray(rng.standard_normal(kf.shape), jnp.float32)
    tables = jnp.asarray(rng.choice(np.arange(1, n_blocks), N * B, replace=False).reshape(N, B), jnp.int32)
    lens, qsl = jnp.full((N,), ctx, jnp.int32), jnp.arange(N + 1, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((N, mc.num_heads, mc.head_dim)), jnp.float32)
    fn = jax.jit(lambda q, k, v, scales: attend(q, k, v, tables, lens, qsl, **scales))
    cases = {}
    for kv in args.kv:
        if kv_cache.is_quantized(kv):
            (k, ks), (v, vs) = kv_cache.quantize(kf, kv), kv_cache.quantize(vf, kv)
            cases[kv] = (q, k, v, dict(k_scale=ks, v_scale=vs))
        else:
            dt = kv_cache.storage_dtype(kv, args.dtype)
            cases[kv] = (q, kf.astype(dt), vf.astype(dt), {})
        jax.block_until_ready(fn(*cases[kv]))
    times = {kv: [] for kv in cases}
    for _ in range(args.rounds * args.replays):
        for kv, a in cases.items():
            times[kv] += timing.samples(fn, *a, reps=1, warmup=0)
    base = statistics.median(times[args.kv[0]])
    return [dict(running=N, kv_cache_dtype=kv, layer_ms=1e3 * statistics.median(t), layer_min_ms=1e3 * min(t),
                 ratio=base / statistics.median(t), all_ms=[1e3 * x for x in t]) for kv, t in times.items()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[128])
    ap.add_argument("--kv", nargs="+", default=["auto", "int8"], help="kv_cache_dtype values; the first is the base")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=3, help="replays of each step per round")
    ap.add_argument("--attention", action="store_true", help="time one layer's reference attention alone")
    bc.add_engine_args(ap)
    args = ap.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
    if args.attention:
        rows = [r for N in args.running for r in attention_times(model_dir, args, N)]
        print(bc.table([[r["running"], r["kv_cache_dtype"], r["layer_ms"], r["layer_min_ms"], r["ratio"]]
                        for r in rows], ["running", "kv_cache_dtype", "ms/layer", "min ms", f"speed vs {args.kv[0]}"]))
        out = dict(results=rows, model=model_dir, context=args.context, machine=bc.machine_info(),
                   note="one layer's reference attention at the decode step's shapes; dtypes interleaved")
        bc.write_json(args.json, out)
        return out
    rows = []
    for N in args.running:
        engines = {kv: filled_engine(model_dir, args, kv, N) for kv in args.kv}
        times = {kv: [] for kv in args.kv}
        for _ in range(args.rounds):
            for kv, (eng, captured) in engines.items():
                times[kv] += replay(eng.runner, captured, args.replays)
        base = N / statistics.median(times[args.kv[0]])
        for kv in args.kv:
            step = statistics.median(times[kv])
            rows.append(dict(running=N, kv_cache_dtype=kv, attention_backend=engines[kv][0].runner.backend,
                             step_ms=1e3 * step, tokens_per_s=N / step,
                             ratio=N / step / base, kv_bytes=engines[kv][0].runner.memory_per_device()[
                                 "kv_bytes_per_device"], all_ms=[1e3 * t for t in times[kv]]))
            bc.say(f"N={N} {kv}: {1e3 * step:.1f} ms/step, {N / step:.0f} tok/s, x{N / step / base:.2f}")
        del engines
    print(bc.table([[r["running"], r["kv_cache_dtype"], r["step_ms"], r["tokens_per_s"], r["ratio"]] for r in rows],
                   ["running", "kv_cache_dtype", "step ms", "tok/s", f"ratio to {args.kv[0]}"]))
    out = dict(results=rows, model=model_dir, dtype=args.dtype, context=args.context, machine=bc.machine_info(),
               note="device time of one captured decode step, engines interleaved per round; medians")
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
