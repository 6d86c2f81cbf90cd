"""`spec.py --vllm`: the same requests through vLLM's offline LLM, plain and with its n-gram proposer.

One worker subprocess per config (vllm_plain, vllm_ngram_k2, vllm_ngram_k4, ...), run one after another
under --vllm-python (jaxpaged/bench/vllm_peer.py says how to install vLLM's CPU build): each starts one
`vllm.LLM` (max_num_seqs = the largest batch size; speculative_config ngram with bench_spec's lookup window
2..5), warms it with one `generate` (the first batch's prompts reversed) and empties its prefix cache, then
for every (workload, batch size) makes `repeats` passes over the requests, prefix caching on as in
jaxpaged's engines (later passes, and batch sizes that share requests, find the prompts cached on both).
Batches are static as on jaxpaged's side: a pass calls `generate` once per batch of b requests, so the
next requests start when the batch ends. Requests are the very prompt token ids jaxpaged gets, greedy,
EOS ignored, min_tokens = max_tokens = the output length. Only `generate` is timed.

Unlike jaxpaged's configs, which alternate pass by pass in one process, vLLM's run back to back: each
engine reserves gpu_memory_utilization of host memory on its CPU backend, and three at once do not fit.

Acceptance comes from vLLM's own counters (`LLM.get_metrics()` with disable_log_stats=False:
spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and the vector
_num_accepted_tokens_per_pos), read before and after each batch; the record keeps jaxpaged's key names
(vLLM's without the `vllm:` prefix), so bench_spec summarizes both sides alike.

This file is also the worker: `python vllm_spec_peer.py JOB.json OUT.json` under vLLM's interpreter
(it imports only the standard library and vllm).
"""
from __future__ import annotations

import json
import sys
import time

NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}  # jaxpaged's n-gram side too


def configs(ks: list[int]) -> list[tuple[str, dict | None]]:
    """(name, vLLM speculative_config) for plain decoding and n-gram with each k."""
    return [("vllm_plain", None)] + [(f"vllm_ngram_k{k}", {**NGRAM, "num_speculative_tokens": k}) for k in ks]


def make_job(model: str, args, spec: dict | None, cases: dict, batch_sizes: list[int]) -> dict:
    """The worker's job: engine settings, and per case key ("workload/b") its requests and batch size.

    `cases` maps a key to (requests with .prompt_ids and .output_len, batch size).
    """
    return dict(model=model, dtype=args.vllm_dtype or args.dtype, seed=args.seed, max_num_seqs=max(batch_sizes),
                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization, speculative_config=spec,
                repeats=args.repeats,
                cases={key: dict(batch_size=b, prompts=[r.prompt_ids for r in reqs],
                                 output_lens=[r.output_len for r in reqs]) for key, (reqs, b) in cases.items()})


def run_configs(model_dir: str, cases: dict, batch_sizes: list[int], ks: list[int], args,
                export_root: str) -> tuple[dict, str]:
    """Every config of `configs(ks)` on every case: ({config: {case key: counts}}, vLLM's version).

    The counts are bench_spec's accumulator (elapsed_s, output_tokens, spec_decode_num_* when speculating).
    """
    from jaxpaged.bench import common as bc
    from jaxpaged.bench import vllm_peer
    model = vllm_peer.hf_dir_for(model_dir, export_root)
    out, version = {}, "unknown"
    for name, spec in configs(ks):
        bc.say(f"vllm: {name} on {len(cases)} (workload, batch size) cases, one engine in a worker")
        got = vllm_peer.call_worker(args, make_job(model, args, spec, cases, batch_sizes), export_root, __file__)
        out[name], version = got["cases"], got["version"]
    return out, version


def _spec_counts(llm) -> dict:
    """vLLM's speculative-decoding counters now, summed over label sets, named as jaxpaged's stats."""
    out = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:")
        if not name.startswith("spec_decode_num"):
            continue
        if hasattr(m, "values"):  # the per-position vector
            prev = out.get(name, [0] * len(m.values))
            out[name] = [a + b for a, b in zip(prev, m.values)]
        else:
            out[name] = out.get(name, 0) + m.value
    return out


def _add(acc: dict, before: dict, after: dict) -> None:
    for k, v in after.items():
        if isinstance(v, list):
            acc[k] = [s + a - b for s, a, b in zip(acc.get(k, [0] * len(v)), v, before.get(k, [0] * len(v)))]
        else:
            acc[k] = acc.get(k, 0) + v - before.get(k, 0)


def _worker(job_path: str, out_path: str) -> None:
    import vllm
    with open(job_path) as f:
        job = json.load(f)
    kw = {k: job[k] for k in ("model", "dtype", "seed", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                              "gpu_memory_utilization")}
    if job["speculative_config"]:
        kw["speculative_config"] = job["speculative_config"]
    llm = vllm.LLM(**kw, disable_log_stats=False)

    def batches(case):
        b, n = case["batch_size"], len(case["prompts"])
        for s in range(0, n, b):
            yield ([{"prompt_token_ids": p} for p in case["prompts"][s:s + b]],
                   [vllm.SamplingParams(max_tokens=m, min_tokens=m, temperature=0.0, ignore_eos=True)
                    for m in case["output_lens"][s:s + b]])

    prompts, params = next(batches(next(iter(job["cases"].values()))))
    # warm-up on the reversed prompts, then forget them: the first pass starts cold, as jaxpaged's does
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts], params, use_tqdm=False)
    llm.reset_prefix_cache()
    results = {}
    for key, case in job["cases"].items():
        acc = dict(elapsed_s=0.0, output_tokens=0, elapsed_s_per_pass=[])
        for _ in range(job["repeats"]):
            elapsed = 0.0
            for prompts, params in batches(case):
                before = _spec_counts(llm)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed += time.perf_counter() - t0
                acc["output_tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                _add(acc, before, _spec_counts(llm))
            acc["elapsed_s"] += elapsed
            acc["elapsed_s_per_pass"].append(elapsed)
        results[key] = acc
    with open(out_path, "w") as f:
        json.dump(dict(cases=results, version=getattr(vllm, "__version__", "unknown")), f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
