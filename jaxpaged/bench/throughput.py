"""Offline throughput of one seeded workload on several backends, side by side in one run.

    jaxpaged bench throughput --num-prompts 128 --backend jaxpaged --backend static \
        --backend hf --hf-batch-size 32 --json results/throughput.json

Backends:
  jaxpaged  continuous batching: a finished request's slot is refilled at the next step.
  static    the same engine (same instance, same compiled steps) with static batching: a batch of up to
            --max-num-seqs requests is queued, runs until its longest request finishes, then the next.
  vllm      vLLM's offline LLM in a subprocess (--vllm-python; skipped with a message when vLLM is not
            importable there): see jaxpaged/bench/vllm_peer.py, which says how to install it.
  hf        transformers `generate` on left-padded batches of --hf-batch-size, same weights and dtype,
            greedy, EOS suppressed (min_new_tokens = max_new_tokens). Each batch runs to its longest
            drawn output length; only each request's own drawn length is counted as output tokens
            (and only real prompt tokens, not padding, as prompt tokens).
All requests arrive at time 0; a request's latency is its finish time, TTFT its first token time
(hf: the batch's first token). Only generation is timed.

--jaxpaged-dtype D (repeatable: `--jaxpaged-dtype float32 --jaxpaged-dtype bfloat16`) runs the engine backends
once per dtype, one engine after the other (jaxpaged-float32 / jaxpaged-bfloat16); with `--vllm-dtype both`
every dtype of both engines is then in one run.

--json-fraction F also runs the jaxpaged backend with that fraction of the requests (every k-th) constrained
by a JSON schema (an object holding an unbounded array of {name, value} records), reported as jaxpaged-json
with the host time spent on grammar masks. A constrained request may finish before its drawn length (its
grammar complete), so compare output tok/s, not elapsed time.

--tensor-parallel-size N (repeatable: `--tensor-parallel-size 1 --tensor-parallel-size 2`) runs the
engine backends once per size, one engine after the other, reported as jaxpaged-tpN / static-tpN. On a
CPU the N devices are simulated (XLA_FLAGS=--xla_force_host_platform_device_count, set here) and share
the same cores, so the ratio measures the overhead of sharding, not a speed-up.
--data-parallel-size M (repeatable) likewise runs M replicas (each on --tensor-parallel-size devices)
behind one LLM, reported with a -dpM suffix; static batching then fills M x --max-num-seqs slots.
"""
from __future__ import annotations

import argparse
import os
import time

from jaxpaged.bench import common as bc
from jaxpaged.bench import vllm_peer

BACKENDS = ("jaxpaged", "static", "hf")  # the default set; vllm runs when asked for
BENCH_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
    "type": "object", "required": ["name", "value"],
    "properties": {"name": {"type": "string"}, "value": {"type": "number"}}}}}}


def run_engine(llm, wl: bc.Workload, static: bool) -> dict:
    eng = llm.engine
    replicas = bc.replica_engines(eng)
    for e in replicas:
        bc.warm_up(e, eng.model_config.vocab_size)
    preempt0 = sum(e.scheduler.num_preemptions for e in replicas)
    mask_s0 = sum(e.structured.mask_seconds for e in replicas)
    masks0 = sum(e.structured.num_masks for e in replicas)
    slots = eng.config.max_num_seqs * len(replicas)
    rec = bc.drive(eng, wl.requests, batch_size=slots if static else None)
    for e in replicas:
        e.block_manager.reset_prefix_cache()  # the next backend starts from the same (empty) cache
    res = bc.summarize(rec)
    res["num_preemptions"] = sum(e.scheduler.num_preemptions for e in replicas) - preempt0
    masks = sum(e.structured.num_masks for e in replicas) - masks0
    mask_s = sum(e.structured.mask_seconds for e in replicas) - mask_s0
    if masks:
        res.update(num_masks=masks, mask_ms_per_step=1e3 * mask_s / rec.num_steps,
                   mask_us_per_masked_token=1e6 * mask_s / masks, mask_share_of_elapsed=mask_s / rec.elapsed_s)
    res.update(tensor_parallel_size=replicas[0].runner.tp, data_parallel_size=len(replicas),
               num_kv_blocks=replicas[0].num_blocks)
    return res


def run_hf(model_dir: str, wl: bc.Workload, args) -> dict:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    bc.say("loading the transformers model")
    model = bc.load_hf_model(model_dir, args.hf_dtype or args.dtype)
    pad = model.config.pad_token_id
    pad = pad if pad is not None else 0

    class StepClock(StoppingCriteria):
        """Records the time each new token lands (called once per generated token); never stops."""
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.monotonic())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(prompts: list[list[int]], new_tokens: int) -> list[float]:
        L = max(map(len, prompts))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
        clock = StepClock()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad, stopping_criteria=StoppingCriteriaList([clock]))
        return clock.times

    generate([[5, 6, 7], [8, 9]], 4)  # warm-up
    reqs, B = wl.requests, args.hf_batch_size
    ttft, lat = [], []
    t0 = time.monotonic()
    for i in range(0, len(reqs), B):
        batch = reqs[i:i + B]
        times = generate([r.prompt_ids for r in batch], max(r.output_len for r in batch))
        ttft += [times[0] - t0] * len(batch)
        lat += [times[r.output_len - 1] - t0 for r in batch]
    elapsed = time.monotonic() - t0
    rec = bc.RunRecord(elapsed, 0, [len(r.prompt_ids) for r in reqs], [r.output_len for r in reqs], ttft, lat)
    res = bc.summarize(rec)
    res.update(hf_batch_size=B, hf_dtype=args.hf_dtype or args.dtype, torch_threads=torch.get_num_threads(),
               note="batches run to their longest request; output tokens counted are each request's drawn length")
    return res  # the model goes with this frame


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", choices=BACKENDS + ("vllm",),
                    help="repeatable; default: all of jaxpaged, static, hf")
    ap.add_argument("--jaxpaged-dtype", action="append", choices=["float32", "bfloat16", "float16"],
                    help="repeatable: the engine backends once per dtype, one engine after the other, labelled "
                         "jaxpaged-float32 / jaxpaged-bfloat16 when more than one (default: --dtype)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-threads", type=int, default=None, help="torch threads for hf (default: torch's choice)")
    ap.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="hf's dtype (default: --dtype), e.g. --dtype bfloat16 --hf-dtype float32 (jaxpaged's "
                    "fast CPU dtype against transformers' usual one)")
    bc.add_workload_args(ap, num_prompts=128, prompt_len=(32, 256), output_len=(16, 256))
    bc.add_engine_args(ap, exclude=("tensor_parallel_size", "data_parallel_size"))  # repeatable here, below
    vllm_peer.add_args(ap, quantization=True)
    ap.add_argument("--json-fraction", type=float, default=0.0,
                    help="also run jaxpaged with this fraction of requests JSON-schema constrained")
    ap.add_argument("--tensor-parallel-size", type=int, action="append", metavar="N",
                    help="devices per engine; repeatable to compare sizes in one run (default 1)")
    ap.add_argument("--data-parallel-size", type=int, action="append", metavar="M",
                    help="replicas behind one LLM; repeatable to compare in one run (default 1)")
    args = ap.parse_args(argv)
    backends = list(dict.fromkeys(args.backend or BACKENDS))
    tp_sizes = list(dict.fromkeys(args.tensor_parallel_size or [1]))
    dp_sizes = list(dict.fromkeys(args.data_parallel_size or [1]))
    devices = max(tp_sizes) * max(dp_sizes)
    flags = os.environ.get("XLA_FLAGS", "")
    if devices > 1 and "xla_force_host_platform_device_count" not in flags:  # before JAX starts
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()

    model_dir = bc.resolve_model(args.model)
    wl = bc.make_workload(args, model_dir)
    engine_info = {k: v for k, v in bc.engine_kwargs(args).items() if k != "show_progress"}
    engine_info.update(tensor_parallel_sizes=tp_sizes, data_parallel_sizes=dp_sizes)
    results = {}

    def run(name, fn):
        bc.say(f"running {name} on {len(wl.requests)} requests")
        r = results[name] = fn()
        bc.say(f"{name}: {r['output_tokens_per_s']:.1f} output tok/s in {r['elapsed_s']:.1f} s")

    skipped = {}
    if "vllm" in backends:  # first: its worker failed to start after the engines had run in this process
        skipped["vllm"] = vllm_peer.unavailable(args)
        if skipped["vllm"] is None:
            from jaxpaged.config import default_cache_dir
            export = os.path.join(default_cache_dir(), "bench-models", "vllm-export")
            for name, d, q in vllm_peer.configurations(args):  # labelled by what differs between them
                run(name, lambda d=d, q=q: vllm_peer.run_vllm(model_dir, wl, args, export, d, q))
        else:
            bc.say(skipped["vllm"])
    engine_dtypes = list(dict.fromkeys(args.jaxpaged_dtype or [args.dtype]))
    engine_info.update(dtype=engine_dtypes[0] if len(engine_dtypes) == 1 else engine_dtypes)
    sizes = [(tp, dp, d) for d in engine_dtypes for tp in tp_sizes for dp in dp_sizes]
    for tp, dp, dtype in sizes if set(backends) & {"jaxpaged", "static"} else []:
        llm = bc.build_llm(model_dir, args, max_model_len=args.max_model_len or bc.workload_max_len(args),
                           tensor_parallel_size=tp, data_parallel_size=dp, dtype=dtype)
        eng = bc.replica_engines(llm.engine)[0]
        engine_info.update(max_model_len=eng.max_model_len, num_kv_blocks=eng.num_blocks,
                           attention_backend=eng.runner.backend, kv_cache_dtype=eng.runner.kv_pool_dtype,
                           buckets=list(eng.runner.buckets))
        suffix = ((f"-{dtype}" if len(engine_dtypes) > 1 else "") + (f"-tp{tp}" if len(tp_sizes) > 1 else "")
                  + (f"-dp{dp}" if len(dp_sizes) > 1 else ""))
        for b in (b for b in backends if b in ("jaxpaged", "static")):
            run(b + suffix, lambda: run_engine(llm, wl, static=b == "static"))
        if args.json_fraction > 0 and "jaxpaged" in backends:
            from jaxpaged import StructuredOutputsParams
            so, every = StructuredOutputsParams(json=BENCH_SCHEMA), max(1, round(1 / args.json_fraction))
            constrained = bc.Workload([bc.Req(r.prompt_ids, r.output_len, r.n, so if i % every == 0 else None)
                                       for i, r in enumerate(wl.requests)], wl.info)
            run("jaxpaged-json" + suffix, lambda: run_engine(llm, constrained, static=False))
        llm = eng = None  # the next size's engine loads after this one is freed
    if "hf" in backends:
        run("hf", lambda: run_hf(model_dir, wl, args))
    out = dict(**bc.run_info("throughput", argv), workload=wl.info, results=results, model=model_dir,
               engine=engine_info, machine=bc.machine_info(), note=bc.TIMING_NOTE,
               skipped={k: v for k, v in skipped.items() if v is not None})
    print(report(out))
    bc.write_json(args.json, out)
    return out


def report(out: dict) -> str:
    """The results as a table, with each backend's output tok/s as a ratio to every other's."""
    res, wl = out["results"], out["workload"]
    names = list(res)
    rows = [[b, r["requests_per_s"], r["output_tokens_per_s"], r["total_tokens_per_s"], r["elapsed_s"],
             r["ttft_s"].get("mean", float("nan")), r["latency_s"].get("p50", float("nan"))]
            + ["-" if o == b else f"{r['output_tokens_per_s'] / res[o]['output_tokens_per_s']:.2f}x" for o in names]
            for b, r in res.items()]
    hdr = ["backend", "req/s", "out tok/s", "total tok/s", "elapsed s", "mean TTFT s", "p50 latency s"]
    hdr += [f"out vs {o}" for o in names]
    head = (f"workload: {wl['num_prompts']} prompts, {wl['dist']}, prompt {wl['prompt_len']} and output "
            f"{wl['output_len']} tokens, {wl['tokens']}; max_num_seqs {out['engine']['max_num_seqs']}\n"
            f"note: {out['note']}")
    skipped = "".join(f"\n{why}" for why in out.get("skipped", {}).values())
    return head + "\n" + bc.table(rows, hdr) + skipped


if __name__ == "__main__":
    main()
