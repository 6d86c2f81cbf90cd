"""Decode step time by kv_cache_dtype, A/B in one run: device time of the same decode step per KV dtype.

    python scripts/bench_kv_cache.py --running 128 --kv auto int8 --rounds 7 --json results/kv_cache.json

For each KV dtype an engine (max_num_seqs = N) is filled with the same N requests (seeded random prompts of
--context tokens) until all of them decode, and its next decode step is captured (bench_host's capture).
Then --rounds rounds replay every engine's captured step --replays times, the engines interleaved within
each round (A, B, A, B, ...), so both see the same machine load; the report is the median device time per
step, tokens/s (N / step time) and the ratio of each dtype's tokens/s to the first one's.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

import bench_common as bc
from bench_host import capture_next_step, replay


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
    captured, saved = capture_next_step(eng.runner)
    eng.step()
    eng.runner._compiled.update(saved)
    return eng, captured


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[128])
    ap.add_argument("--kv", nargs="+", default=["auto", "int8"], help="kv_cache_dtype values; the first is the base")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=3, help="replays of each step per round")
    bc.add_engine_args(ap)
    args = ap.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
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
            rows.append(dict(running=N, kv_cache_dtype=kv, step_ms=1e3 * step, tokens_per_s=N / step,
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
