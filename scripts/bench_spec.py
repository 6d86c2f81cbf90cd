"""Speculative decoding (n-gram or draft-model proposals) against plain decoding on the same requests.

    python scripts/bench_spec.py --json docs/results/spec.json
    python scripts/bench_spec.py --method draft_model --draft DIR --json docs/results/spec_draft.json

Two workloads on the default model (greedy, chat template): (a) input-grounded — the model is asked to
repeat / lightly rewrite a paragraph of this repository's docs, so outputs copy spans of the prompt; (b)
free generation — short open questions. For each batch size (static batches: the next requests start
when the batch ends) and each k: time per output token and throughput, plain vs speculative, the ratio, the
acceptance per position, and the governor's decision (jaxpaged/spec_decode/governor.py). Greedy outputs
with speculation equal the plain ones token for token (tests/test_spec_decode.py). Only generation is
timed: engines are built and warmed before.
"""
from __future__ import annotations

import argparse
import os

import bench_common as bc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["Why is the sky blue?", "Give three tips for staying healthy.", "What is a neural network?",
             "Describe a day at the beach.", "How do plants make food?", "What makes a good friend?",
             "Explain how a bicycle works.", "Write a short poem about autumn."]
ASKS = ["Repeat the following text exactly, word for word:\n\n{}", "Copy this paragraph, fixing any typos:\n\n{}",
        "Rewrite the following text with the same wording, as plain prose:\n\n{}"]


def _paragraphs(n: int) -> list[str]:
    """n prose paragraphs (60 to 160 words) from the shipped docs."""
    out = []
    for name in ("docs/architecture.md", "README.md", "docs/server.md"):
        path = os.path.join(ROOT, name)
        if not os.path.isfile(path):
            continue
        for p in open(path).read().split("\n\n"):
            words = p.split()
            if 60 <= len(words) <= 160 and not p.lstrip().startswith(("|", "```", "#", "-", "    ")):
                out.append(" ".join(words))
    if len(out) < n:
        raise SystemExit(f"only {len(out)} paragraphs found for the input-grounded workload")
    return out[:n]


def _workload(tok, kind: str, n: int, output_len: int) -> list:
    if kind == "grounded":
        texts = [ASKS[i % len(ASKS)].format(p) for i, p in enumerate(_paragraphs(n))]
    else:
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [bc.Req(tok.apply_chat_template([{"role": "user", "content": t}]), output_len) for t in texts]


class _NeverPropose:
    """A governor that never lets the engine propose (--control)."""
    def should_propose(self, batch_size):
        return False

    def record(self, *args):
        pass

    def summary(self):
        return {}


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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--ks", default="2,4", help="num_speculative_tokens values")
    ap.add_argument("--workloads", default="grounded,free")
    ap.add_argument("--requests-per-batch-size", type=int, default=0,
                    help="requests per (workload, batch size); 0: max(batch size, 4)")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the requests, the configs alternating")
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"), help="the proposer")
    ap.add_argument("--draft", default=None, help="--method draft_model: the draft (a directory or a random: preset "
                    "as --model takes; the target's vocabulary)")
    ap.add_argument("--control", action="store_true", help="also a speculative engine (the largest k) that "
                    "never proposes: what the speculative step costs when nobody speculates")
    bc.add_engine_args(ap, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, num_kv_blocks=512)
    args = ap.parse_args(argv)
    if (args.method == "draft_model") != (args.draft is not None):
        ap.error("--draft DIR goes with --method draft_model (and only with it)")
    model_dir = bc.resolve_model(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    method = ({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5} if args.method == "ngram"
              else {"method": "draft_model", "model": bc.resolve_model(args.draft)})
    configs = [("plain", None)] + [(f"{args.method}_k{k}", {**method, "num_speculative_tokens": k}) for k in ks]
    results = {w: {str(b): {} for b in batch_sizes} for w in args.workloads.split(",")}
    engines = {}
    for name, spec in configs:  # all built first: the runs below alternate, so a change of load hits all
        engines[name] = bc.build_llm(model_dir, args, speculative_config=spec, max_num_seqs=max(batch_sizes))
        bc.warm_up(engines[name].engine, engines[name].engine.model_config.vocab_size)
    if args.control:
        spec = dict(configs[-1][1])
        engines["never_proposing"] = bc.build_llm(model_dir, args, speculative_config=spec,
                                                  max_num_seqs=max(batch_sizes))
        engines["never_proposing"].engine.spec.governor = _NeverPropose()
        bc.warm_up(engines["never_proposing"].engine, engines["never_proposing"].engine.model_config.vocab_size)
    tok = engines["plain"].tokenizer
    for w in results:
        for b in batch_sizes:
            n = args.requests_per_batch_size or max(b, 4)
            reqs = _workload(tok, w, n, args.output_len)
            acc = {name: {} for name in engines}
            for rep in range(args.repeats):
                for name, llm in engines.items():
                    _run(llm, reqs, b, acc[name])
                    bc.say(f"{w} batch {b} pass {rep}: {name} {acc[name]['elapsed_s'] / acc[name]['output_tokens'] * 1e3:.2f} ms/token so far")
            results[w][str(b)] = {name: _summary(a) for name, a in acc.items()}
    rows = []
    for w, per_b in results.items():
        for b, per_c in per_b.items():
            base = per_c["plain"]["time_per_output_token_s"]
            for name, r in per_c.items():
                r["ratio_to_plain"] = r["time_per_output_token_s"] / base
                rows.append([w, b, name, r["time_per_output_token_s"] * 1e3, r["output_tokens_per_s"],
                             r["ratio_to_plain"], r.get("mean_accepted_per_draft", "-"),
                             " ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_pos", [])) or "-"])
    print(bc.table(rows, ["workload", "batch", "config", "ms/token", "tok/s", "x plain", "acc/draft",
                          "accept rate per pos"]))
    out = dict(results=results, machine=bc.machine_info(), note=bc.TIMING_NOTE + "; vLLM not measured: it is "
               "not installed here (no CPU build in this environment)", args=vars(args))
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
