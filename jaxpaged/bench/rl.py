"""The costs of the RL controls, side by side in one run (docs/research.md, "The RL recipe"):

    jaxpaged bench rl --num-prompts 128 --json docs/results/rl.json

- batch_invariant off vs on: the 128-request workload of jaxpaged/bench/throughput.py, the same engine
  settings, one engine after the other (compile seconds reported too);
- sleep / wake: `sleep(1)` + `wake_up()` and `sleep(2)` + `wake_up(reload=True)` seconds, with the
  device bytes before and after (`jax.live_arrays`; `memory_stats()` where the backend has it), for the
  default model and a random model of Llama-3.2-1B's shapes (--sleep-model, in --sleep-dtype; no
  generation is timed on it, only sleep and wake).
"""
from __future__ import annotations

import argparse
import time

from jaxpaged.bench import common as bc
from jaxpaged.bench.throughput import run_engine


def sleep_wake(llm) -> dict:
    """Seconds and device bytes of sleep / wake at each level on an idle engine."""
    out = {}
    for level, reload in ((1, False), (2, True)):
        t0 = time.perf_counter()
        slept = llm.sleep(level=level)
        t1 = time.perf_counter()
        woken = llm.wake_up(reload=reload)
        t2 = time.perf_counter()
        out[f"level{level}"] = dict(sleep_s=t1 - t0, wake_s=t2 - t1, reload=reload,
                                    bytes_awake=slept["before"], bytes_asleep=slept["after"],
                                    bytes_woken=woken["after"])
        bc.say(f"sleep({level}) {t1 - t0:.2f} s, wake_up(reload={reload}) {t2 - t1:.2f} s; engine bytes "
               f"{slept['before']['engine_bytes'] / 2**20:.0f} -> {slept['after']['engine_bytes'] / 2**20:.0f}"
               f" -> {woken['after']['engine_bytes'] / 2**20:.0f} MiB")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_workload_args(ap, num_prompts=128, prompt_len=(32, 256), output_len=(16, 256))
    bc.add_engine_args(ap)
    ap.add_argument("--sleep-model", default="random:llama-1b", help="second model for sleep / wake timings")
    ap.add_argument("--sleep-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
    wl = bc.make_workload(args, model_dir)
    results, compile_s, sleep = {}, {}, {}
    for invariant in (False, True):
        name = "batch_invariant" if invariant else "default"
        llm = bc.build_llm(model_dir, args, max_model_len=args.max_model_len or bc.workload_max_len(args),
                           batch_invariant=invariant)
        compile_s[name] = llm.stats()["compile_seconds"]
        bc.say(f"running {name} on {len(wl.requests)} requests")
        results[name] = run_engine(llm, wl, static=False)
        bc.say(f"{name}: {results[name]['output_tokens_per_s']:.1f} output tok/s")
        if not invariant:
            sleep["default_model"] = sleep_wake(llm)
        del llm
    other = bc.resolve_model(args.sleep_model)
    llm = bc.build_llm(other, args, dtype=args.sleep_dtype, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=512, warmup=False)
    sleep[args.sleep_model] = sleep_wake(llm)
    ratio = results["batch_invariant"]["output_tokens_per_s"] / results["default"]["output_tokens_per_s"]
    bc.say(f"batch_invariant: {ratio:.3f}x the default's output tok/s")
    out = dict(workload=wl.info, results=results, batch_invariant_throughput_ratio=ratio,
               compile_seconds=compile_s, sleep_wake=sleep, model=model_dir,
               engine={k: v for k, v in bc.engine_kwargs(args).items() if k != "show_progress"},
               sleep_model=dict(model=args.sleep_model, dtype=args.sleep_dtype),
               machine=bc.machine_info(), note=bc.TIMING_NOTE)
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
