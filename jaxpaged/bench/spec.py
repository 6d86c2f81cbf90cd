"""Speculative decoding (n-gram or draft-model proposals) against plain decoding on the same requests.

    jaxpaged bench spec --json docs/results/spec.json
    jaxpaged bench spec --method draft_model --draft DIR --json docs/results/spec_draft.json
    jaxpaged bench spec --vllm --vllm-python ~/vllm-venv/bin/python --json docs/results/spec_vllm.json

Two workloads on the default model (greedy, chat template): (a) input-grounded — the model is asked to
repeat / lightly rewrite a paragraph of prose (--grounding-text: by default the checkout's docs, read from
the current directory), so outputs copy spans of the prompt; (b)
free generation — short open questions. For each batch size (static batches: the next requests start
when the batch ends) and each k: time per output token and throughput, plain vs speculative, the ratio, the
acceptance per position, and the governor's decode step time per token bucket
(jaxpaged/spec_decode/governor.py). Greedy outputs
with speculation equal the plain ones token for token (tests/test_spec_decode.py). Only generation is
timed: engines are built and warmed before.

--vllm: vLLM's offline LLM runs the same requests first, plain and with its n-gram proposer for each k
(rows vllm_plain, vllm_ngram_k2, ...; jaxpaged/bench/vllm_spec_peer.py says how), each row also as a ratio to
jaxpaged's plain; when vLLM cannot be imported under --vllm-python the note says why and only jaxpaged runs.
"""
from __future__ import annotations

import argparse
import os
import statistics

from jaxpaged.bench import common as bc
from jaxpaged.bench import vllm_peer, vllm_spec_peer
from jaxpaged.core.tokenizer import Tokenizer

QUESTIONS = ["Why is the sky blue?", "Give three tips for staying healthy.", "What is a neural network?",
             "Describe a day at the beach.", "How do plants make food?", "What makes a good friend?",
             "Explain how a bicycle works.", "Write a short poem about autumn."]
ASKS = ["Repeat the following text exactly, word for word:\n\n{}", "Copy this paragraph, fixing any typos:\n\n{}",
        "Rewrite the following text with the same wording, as plain prose:\n\n{}"]


GROUNDING_TEXT = ("docs/architecture.md", "README.md", "docs/server.md")


def _paragraphs(n: int, files=GROUNDING_TEXT) -> list[str]:
    """n prose paragraphs (60 to 160 words) from the text files `files` (missing ones skipped)."""
    out = []
    for path in files:
        if not os.path.isfile(path):
            continue
        for p in open(path).read().split("\n\n"):
            words = p.split()
            if 60 <= len(words) <= 160 and not p.lstrip().startswith(("|", "```", "#", "-", "    ")):
                out.append(" ".join(words))
    if len(out) < n:
        raise SystemExit(f"only {len(out)} paragraphs found for the input-grounded workload in {list(files)} "
                         "(--grounding-text; run from a checkout for its docs)")
    return out[:n]


def _workload(tok, kind: str, n: int, output_len: int, files=GROUNDING_TEXT) -> list:
    if tok is None:
        raise SystemExit("--model: the workloads are chat prompts; this model directory has no tokenizer")
    if kind == "grounded":
        texts = [ASKS[i % len(ASKS)].format(p) for i, p in enumerate(_paragraphs(n, files))]
    else:
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [bc.Req(tok.apply_chat_template([{"role": "user", "content": t}]), output_len) for t in texts]


class _NeverPropose:
    """A proposer that never proposes (--control): the speculative engine's cost where nobody speculates."""
    def propose(self, req, k):
        return []

    def retain(self, request_ids):
        pass


def _spec_counts(eng) -> dict:
    return {k: v for k, v in eng.stats().items() if k.startswith("spec_decode_num")}


def _run(llm, reqs, batch_size: int, acc: dict) -> None:
    """One pass of `reqs`; adds its elapsed time, tokens and proposal counts to `acc`."""
    eng = llm.engine
    before = _spec_counts(eng)
    rec = bc.drive(eng, reqs, batch_size=batch_size)
    acc["elapsed_s"] = acc.get("elapsed_s", 0.0) + rec.elapsed_s
    acc["output_tokens"] = acc.get("output_tokens", 0) + sum(rec.output_tokens)
    acc["num_steps"] = acc.get("num_steps", 0) + rec.num_steps
    acc.setdefault("pass_time_per_output_token_s", []).append(rec.elapsed_s / max(sum(rec.output_tokens), 1))
    after = eng.stats()
    for k, v in before.items():
        if isinstance(v, list):  # accepted per position
            acc[k] = [s + a - b for s, a, b in zip(acc.get(k, [0] * len(v)), after[k], v)]
        else:
            acc[k] = acc.get(k, 0) + after[k] - v
    if before:
        acc["governor"], acc["propose_seconds"] = after["spec_decode_governor"], after["spec_decode_propose_seconds"]


def _summary(acc: dict) -> dict:
    r = dict(time_per_output_token_s=acc["elapsed_s"] / max(acc["output_tokens"], 1),
             output_tokens_per_s=acc["output_tokens"] / acc["elapsed_s"], **acc)
    drafts = acc.get("spec_decode_num_drafts")
    if drafts is not None:
        per_pos = acc["spec_decode_num_accepted_tokens_per_pos"]
        r.update(acceptance_rate_per_pos=[a / drafts if drafts else 0.0 for a in per_pos],
                 mean_accepted_per_draft=acc["spec_decode_num_accepted_tokens"] / drafts if drafts else 0.0)
    return r


def _vllm_side(model_dir: str, cases: dict, batch_sizes: list[int], ks: list[int], args) -> tuple[dict, str]:
    """vLLM on the same requests: ({(workload, b): {config: summary}}, the note's sentence about vLLM)."""
    if not args.vllm:
        return {}, "vLLM not measured (--vllm runs its n-gram side by side)"
    why = vllm_peer.unavailable(args)
    if why:
        bc.say(why)
        return {}, why
    from jaxpaged.config import default_cache_dir
    export = os.path.join(default_cache_dir(), "bench-models", "vllm-export")
    keyed = {f"{w}/{b}": (reqs, b) for (w, b), reqs in cases.items()}
    per_config, version = vllm_spec_peer.run_configs(model_dir, keyed, batch_sizes, ks, args, export)
    out = {case: {name: _summary(got[f"{case[0]}/{case[1]}"]) for name, got in per_config.items()} for case in cases}
    return out, (f"vLLM {version} ran the same requests (dtype {args.vllm_dtype or args.dtype}, "
                 f"OMP_NUM_THREADS={args.vllm_threads} bound to {args.vllm_cpu_bind}, one generate per static "
                 "batch, its configs back to back in their own workers)")


def _add_ratios(per_c: dict) -> None:
    """ratio_to_plain: time per token over its own engine's plain (jaxpaged's or vLLM's); jaxpaged's rows
    also median_pass_ratio (the median over passes of the pass's ratio: a pass the machine slowed for one
    engine weighs less), vLLM's ratio_to_jaxpaged_plain."""
    for name, r in per_c.items():
        own = "vllm_plain" if name.startswith("vllm_") else "plain"
        r["ratio_to_plain"] = r["time_per_output_token_s"] / per_c[own]["time_per_output_token_s"]
        if own == "plain":  # the engines alternate pass by pass: each pass against plain's same pass
            r["median_pass_ratio"] = statistics.median(a / b for a, b in zip(
                r["pass_time_per_output_token_s"], per_c["plain"]["pass_time_per_output_token_s"]))
        if own == "vllm_plain":
            r["ratio_to_jaxpaged_plain"] = r["time_per_output_token_s"] / per_c["plain"]["time_per_output_token_s"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--ks", default="2,4", help="num_speculative_tokens values")
    ap.add_argument("--workloads", default="grounded,free")
    ap.add_argument("--grounding-text", nargs="+", default=list(GROUNDING_TEXT), metavar="FILE",
                    help="the text files whose paragraphs the grounded workload asks to repeat")
    ap.add_argument("--requests-per-batch-size", type=int, default=0,
                    help="requests per (workload, batch size); 0: max(batch size, 4)")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the requests, the configs alternating")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"), help="the proposer")
    ap.add_argument("--draft", default=None, help="--method draft_model: the draft (a directory or a random: preset "
                    "as --model takes; the target's vocabulary)")
    ap.add_argument("--control", action="store_true", help="also a speculative engine (the largest k) that "
                    "never proposes: what the speculative step costs when nobody speculates")
    ap.add_argument("--vllm", action="store_true", help="also vLLM plain and n-gram (each k) on the same requests, "
                    "in workers under --vllm-python (--method ngram only)")
    bc.add_engine_args(ap, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, num_kv_blocks=512)
    vllm_peer.add_args(ap, dtype="float32")
    return ap


def main(argv=None) -> dict:
    ap = _parser()
    args = ap.parse_args(argv)
    if (args.method == "draft_model") != (args.draft is not None):
        ap.error("--draft DIR goes with --method draft_model (and only with it)")
    if args.vllm and args.method != "ngram":
        ap.error("--vllm compares vLLM's n-gram proposer: it goes with --method ngram")
    model_dir = bc.resolve_model(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    method = (vllm_spec_peer.NGRAM if args.method == "ngram"  # the lookup window both sides use
              else {"method": "draft_model", "model": bc.resolve_model(args.draft)})
    configs = [("plain", None)] + [(f"{args.method}_k{k}", {**method, "num_speculative_tokens": k}) for k in ks]
    tok = Tokenizer.from_dir(model_dir)
    cases = {(w, b): _workload(tok, w, args.requests_per_batch_size or max(b, 4), args.output_len,
                              args.grounding_text)
             for w in args.workloads.split(",") for b in batch_sizes}
    # vLLM first: its worker does not start beside this process's engines (throughput.py found)
    vllm_results, vllm_note = _vllm_side(model_dir, cases, batch_sizes, ks, args)
    engines = {}
    for name, spec in configs:  # all built first: the runs below alternate, so a change of load hits all
        engines[name] = bc.build_llm(model_dir, args, speculative_config=spec, max_num_seqs=max(batch_sizes))
        bc.warm_up(engines[name].engine, engines[name].engine.model_config.vocab_size)
    if args.control:
        spec = dict(configs[-1][1])
        engines["never_proposing"] = bc.build_llm(model_dir, args, speculative_config=spec,
                                                  max_num_seqs=max(batch_sizes))
        engines["never_proposing"].engine.spec.proposer = _NeverPropose()
        bc.warm_up(engines["never_proposing"].engine, engines["never_proposing"].engine.model_config.vocab_size)
    results = {w: {} for w, _ in cases}
    for (w, b), reqs in cases.items():
        acc = {name: {} for name in engines}
        for rep in range(args.repeats):
            for name, llm in engines.items():
                _run(llm, reqs, b, acc[name])
                ms = acc[name]["elapsed_s"] / acc[name]["output_tokens"] * 1e3
                bc.say(f"{w} batch {b} pass {rep}: {name} {ms:.2f} ms/token so far")
        results[w][str(b)] = {name: _summary(a) for name, a in acc.items()} | vllm_results.get((w, b), {})
    rows = []
    for w, per_b in results.items():
        for b, per_c in per_b.items():
            _add_ratios(per_c)
            for name, r in per_c.items():
                rows.append([w, b, name, r["time_per_output_token_s"] * 1e3, r["output_tokens_per_s"],
                             r["ratio_to_plain"], r.get("median_pass_ratio", "-"),
                             r.get("ratio_to_jaxpaged_plain", "-"),
                             r.get("mean_accepted_per_draft", "-"),
                             " ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_pos", [])) or "-"])
    print(bc.table(rows, ["workload", "batch", "config", "ms/token", "tok/s", "x plain", "median pass x",
                          "x jaxpaged plain",
                          "acc/draft", "accept rate per pos"]))
    out = dict(results=results, machine=bc.machine_info(), note=f"{bc.TIMING_NOTE}; {vllm_note}", args=vars(args))
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
