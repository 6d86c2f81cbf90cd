"""Grammar mask cost on the host: xgrammar vs llguidance per token, and the engine's per-step mask fill.

    jaxpaged bench grammar [--model DIR] [--slots 64] [--json out.json]

1. Both libraries (xgrammar only if installed) under one nested JSON schema (enums, bounds, arrays): one
   matcher walks the tokens of a conforming document; per token, the time to fill the mask over the whole
   vocabulary and to accept the token. Also each library's import, tokenizer setup and schema compile time.
2. `jaxpaged.core.structured.StructuredOutputs.bitmask_arrays` with --slots constrained requests advancing
   together, as in a decode step: host milliseconds per step and microseconds per constrained token.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}},
                         "address": {"type": "object", "required": ["city", "zip"], "properties": {
                             "city": {"type": "string"}, "zip": {"type": "string"}}}}}
DOC = {"name": "John Smith, the third of his name", "age": 42, "tags": ["alpha", "gamma", "beta"],
       "address": {"city": "Paris", "zip": "75001"}}


def stats(ts) -> dict:
    ts = np.asarray(ts) * 1e6
    return dict(median_us=float(np.median(ts)), mean_us=float(ts.mean()), p99_us=float(np.percentile(ts, 99)))


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def walk(fill, accept, new_matcher, ids, reps=5):
    fills, accepts = [], []
    for _ in range(reps):
        m = new_matcher()
        for t in ids:
            a = time.perf_counter()
            fill(m)
            b = time.perf_counter()
            assert accept(m, t), t
            fills.append(b - a)
            accepts.append(time.perf_counter() - b)
    return dict(fill=stats(fills), accept=stats(accepts))


def bench_llguidance(tok_json: str, V: int, eos: int, ids) -> dict:
    import llguidance
    import llguidance.numpy as lln
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, n_vocab=V, eos_token=eos)
    t1 = time.perf_counter()
    grammar = llguidance.grammar_from("json_schema", json.dumps(SCHEMA))
    llguidance.LLMatcher(lt, grammar)
    t2 = time.perf_counter()
    mask = lln.allocate_token_bitmask(1, V)
    res = walk(lambda m: lln.fill_next_token_bitmask(m, mask, 0), lambda m, t: m.consume_token(t),
               lambda: llguidance.LLMatcher(lt, grammar), ids)
    return dict(version=llguidance.__version__, import_s=import_seconds("llguidance"), tokenizer_s=t1 - t0,
                compile_ms=1e3 * (t2 - t1), **res)


def bench_xgrammar(model_dir: str, V: int, eos_token: str, ids) -> dict | None:
    try:
        import transformers
        import xgrammar
    except ImportError:
        return None
    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json", eos_token=eos_token)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=V))
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    mask = xgrammar.allocate_token_bitmask(1, V)
    res = walk(lambda m: m.fill_next_token_bitmask(mask, 0), lambda m, t: m.accept_token(t),
               lambda: xgrammar.GrammarMatcher(compiled), ids)
    from importlib.metadata import version
    return dict(version=version("xgrammar"), import_s=import_seconds("xgrammar"), tokenizer_s=t1 - t0,
                compile_ms=1e3 * (t2 - t1), **res)


def bench_engine_masks(model_dir: str, V: int, eos: int, ids, slots: int) -> dict:
    from jaxpaged.core.request import Request
    from jaxpaged.core.sampling_params import SamplingParams
    from jaxpaged.core.structured import StructuredOutputs, StructuredOutputsParams
    so = StructuredOutputs(f"{model_dir}/tokenizer.json", V, slots, [eos])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    reqs = []
    for s in range(slots):
        r = Request(str(s), str(s), 0, [1], params, 0)
        r.slot = s
        reqs.append(r)
    so.bitmask_arrays([(r, 1) for r in reqs], slots)  # matchers created (grammar compiled once, copied)
    steps = []
    for t in ids:
        for r in reqs:
            r.token_ids.append(t)
            r.num_computed_tokens = len(r.token_ids) - 1
        a = time.perf_counter()
        so.bitmask_arrays([(r, 1) for r in reqs], slots)
        steps.append(time.perf_counter() - a)
    ms = 1e3 * float(np.mean(steps))
    return dict(slots=slots, ms_per_step=ms, us_per_constrained_token=1e3 * ms / slots)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from jaxpaged.config import ModelConfig
    from jaxpaged.core.tokenizer import Tokenizer
    if args.model is None:
        from jaxpaged.checkpoints.default_model import default_model_dir
        args.model = default_model_dir()
    V, tok = ModelConfig.from_dir(args.model).vocab_size, Tokenizer.from_dir(args.model)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    with open(f"{args.model}/tokenizer.json") as f:
        tok_json = f.read()
    out = dict(model=args.model, vocab_size=V, doc_tokens=len(ids),
               llguidance=bench_llguidance(tok_json, V, tok.eos_token_id, ids),
               xgrammar=bench_xgrammar(args.model, V, tok.special["eos_token"], ids),
               engine=bench_engine_masks(args.model, V, tok.eos_token_id, ids, args.slots))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
