"""Shared-prefix workload (one long system prompt + short questions): TTFT and throughput with prefix
caching on vs off, same engine settings, same requests, in one run.

    jaxpaged bench prefix --system-len 1024 --num-prompts 32 --json results/prefix.json

Requests arrive all at once (default) or as a Poisson process (--request-rate R per second); TTFT is
measured from each request's arrival. Only generation is timed.
"""
from __future__ import annotations

import argparse
import gc

import numpy as np

from jaxpaged.bench import common as bc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-len", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: a burst)")
    bc.add_workload_args(ap, num_prompts=32, prompt_len=(16, 64), output_len=(16, 64))
    bc.add_engine_args(ap)
    args = ap.parse_args(argv)

    model_dir = bc.resolve_model(args.model)
    wl = bc.make_workload(args, model_dir, prefix_len=args.system_len)
    wl.info.update(question_len=wl.info.pop("prompt_len"), request_rate=args.request_rate)
    arrivals = None
    if np.isfinite(args.request_rate):
        gaps = np.random.default_rng(args.seed + 7).exponential(1 / args.request_rate, len(wl.requests))
        arrivals = np.cumsum(gaps) - gaps[0]
    max_len = args.max_model_len or bc.workload_max_len(args, args.system_len)
    results = {}
    for name, on in (("prefix_caching_on", True), ("prefix_caching_off", False)):
        llm = bc.build_llm(model_dir, args, max_model_len=max_len, enable_prefix_caching=on)
        eng = llm.engine
        bc.warm_up(eng, eng.model_config.vocab_size)
        bm = eng.block_manager
        bm.hit_tokens = bm.queried_tokens = 0
        bc.say(f"{name}: {len(wl.requests)} requests")
        rec = bc.drive(eng, wl.requests, arrivals=arrivals)
        results[name] = dict(bc.summarize(rec), prefix_cache_hit_rate=bm.prefix_cache_hit_rate)
        del llm, eng, bm
        gc.collect()
    on, off = results["prefix_caching_on"], results["prefix_caching_off"]
    out = dict(workload=wl.info, results=results, model=model_dir,
               ratios=dict(mean_ttft_off_over_on=off["ttft_s"]["mean"] / on["ttft_s"]["mean"],
                           p50_ttft_off_over_on=off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
                           output_tokens_per_s_on_over_off=on["output_tokens_per_s"] / off["output_tokens_per_s"]),
               engine={k: v for k, v in bc.engine_kwargs(args, max_model_len=max_len).items() if k != "show_progress"},
               machine=bc.machine_info(), note=bc.TIMING_NOTE)
    print(report(out))
    bc.write_json(args.json, out)
    return out


def report(out: dict) -> str:
    rows = [[name.replace("prefix_caching_", "prefix caching "), r["ttft_s"]["mean"], r["ttft_s"]["p50"],
             r["ttft_s"]["p99"], r["output_tokens_per_s"], r["total_tokens_per_s"], r["elapsed_s"],
             r["prefix_cache_hit_rate"]] for name, r in out["results"].items()]
    t = bc.table(rows, ["run", "mean TTFT s", "p50 TTFT s", "p99 TTFT s", "out tok/s", "total tok/s", "elapsed s",
                        "hit rate"])
    r, wl = out["ratios"], out["workload"]
    return (f"workload: {wl['num_prompts']} requests, system prompt {wl['shared_prefix_len']} tokens + questions "
            f"{wl['question_len']}, outputs {wl['output_len']}, rate {wl['request_rate']}/s\nnote: {out['note']}\n{t}\n"
            f"mean TTFT off/on: {r['mean_ttft_off_over_on']:.2f}x; output tok/s on/off: "
            f"{r['output_tokens_per_s_on_over_off']:.2f}x")


if __name__ == "__main__":
    main()
