"""Quality of quantized weights (and KV caches) against the model's own float32 run, on the golden prompts.

    jaxpaged bench quality --weights float32 int8 fp8 --json docs/results/quality.json
    jaxpaged bench quality --weights float32 int8 int4 --max-tokens 64   # integer weights (issue 44's goals)
    jaxpaged bench quality --weights float32 int8:g128 int4:sym int4:xla --max-tokens 64   # their options
    jaxpaged bench quality --weights float32 --kv auto bfloat16 int8 float8_e4m3fn   # KV caches alone

The float32 engine (float32 weights, float32 KV) generates greedily from each golden prompt of the
default model (jaxpaged/testing/prompts.py, also tests/test_default_model.py's: four texts, three chats;
--max-tokens each, EOS ignored).
Every configuration is then teacher-forced on those float32 tokens: one request per prompt, prompt +
float32 tokens, scored by its prompt logprobs (the top --top-logprobs and the given token's, at every
position, over the configuration's weights and KV cache: the prefill writes K/V to the cache and attends
over it), and reports
  - greedy agreement: the share of positions where its greedy token equals the float32 token;
  - mean / max |delta logprob| of the float32 token: its logprob there minus float32's own (computed
    the same teacher-forced way); `outside_top` counts the positions where that token is not among the
    configuration's top logprobs.
Each configuration row: weights (--weights: float32, bfloat16 (the engine dtype: weights and activations),
int8, int4 (groups of 32), fp8 (weight-only, float32 activations; int8 / int4 products on the quantized CPU
kernel where it runs, which rounds activations per 32 entries to int16 codes for int8 weights, int8 for
int4), bfloat16-int8 / bfloat16-int4 (bfloat16 activations and KV); a quantized name takes options after
colons (`weights_config`): gN or channel (quantization_group_size N or per output channel), sym / asym
(quantization_symmetric), xla (matmul_backend xla: XLA's dequantize-then-dot, float activations), a8 / a16
(quantization_activation_bits: the kernel's activation codes), e.g. int4:g32:sym:xla, int8:a8)
x KV cache dtype (--kv, passed to the engine as the `kv_cache_dtype` keyword when not `auto`;
`auto` is the engine dtype). The goals: GOAL_INT8_WEIGHTS for int8 weights (GOAL_INT4_WEIGHTS: int4, and
GOAL_GREEDY_INT8 the greedy agreement issue 44 asks of int8), GOAL_KV per KV cache dtype
(float32 weights), both asserted by tests (test_quality.py, test_kv_quality.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.testing.prompts import golden_prompts

GOAL_INT8_WEIGHTS = 0.05  # mean |delta logprob| of int8 weights (issue 14)
GOAL_INT4_WEIGHTS = 0.1  # mean |delta logprob| of int4 weights, groups of 32 (issue 44)
GOAL_GREEDY_INT8 = 0.95  # greedy agreement of int8 weights over 64 tokens (issue 44)
GOAL_INT8_DEFAULT = 0.02  # mean |delta logprob| of int8's default form (groups of 32, minimum; issue 44)
GOAL_KV = {"bfloat16": 0.005, "int8": 0.02}  # mean |delta logprob| of the KV cache dtype, float32 weights


DTYPES = ("float32", "bfloat16")
QUANTIZED = ("int8", "int4", "fp8")
OPTIONS = "gN (N in 16, 32, 64, 128), channel, sym, asym, xla, a8, a16"


def weights_config(weights: str) -> dict:
    """A --weights name -> the engine keywords it stands for: [bfloat16-]NAME[:OPTION ...], NAME an engine
    dtype or a quantization, each OPTION one of OPTIONS (quantized names only). ValueError naming it."""
    name, *options = weights.split(":")
    dtype, _, quant = name.rpartition("-")  # "bfloat16-int8", or one name
    if dtype not in ("", "bfloat16") or quant not in DTYPES + QUANTIZED or (dtype and quant in DTYPES):
        raise ValueError(f"--weights {weights!r}: the name must be one of {', '.join(DTYPES + QUANTIZED)}, a "
                         "quantized one optionally after 'bfloat16-'")
    if quant in DTYPES:
        if options:
            raise ValueError(f"--weights {weights!r}: options ({OPTIONS}) take a quantized name")
        return dict(dtype=quant, quantization=None)
    kw = dict(dtype=dtype or "float32", quantization=quant)
    for o in options:
        if o in ("sym", "asym"):
            kw["quantization_symmetric"] = o == "sym"
        elif o == "xla":
            kw["matmul_backend"] = "xla"
        elif o in ("a8", "a16"):
            kw["quantization_activation_bits"] = int(o[1:])
        elif o == "channel" or (o[:1] == "g" and o[1:].isdigit()):
            kw["quantization_group_size"] = 0 if o == "channel" else int(o[1:])
        else:
            raise ValueError(f"--weights {weights!r}: unknown option {o!r}; options: {OPTIONS}")
    from jaxpaged.config import EngineConfig
    EngineConfig(**kw)  # a group or symmetry the format does not take: ValueError naming the field
    return kw


def _weights_arg(weights: str) -> str:
    try:
        weights_config(weights)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return weights


def engine(model_dir: str, args, weights: str, kv: str):
    over = dict(weights_config(weights), max_logprobs=args.top_logprobs)
    if kv != "auto":
        over["kv_cache_dtype"] = kv
    return bc.build_llm(model_dir, args, **over)


def layer_bytes_per_weight(llm) -> float | None:
    """Bytes a layer-matrix weight takes in the engine's format (codes, scales, minima; the kernel's packing
    or the QArray's 4-bit codes as packed nibbles), None for plain float weights."""
    from jaxpaged.models.qarray import QArray
    w = llm.engine.runner.params["layers"]["w_up"]
    if isinstance(w, QArray):
        bits, has_min, group = w.bits, w.m is not None, w.group or w.shape[-2]
    elif hasattr(w, "layout"):  # QPacked
        bits, has_min, group = w.bits, w.has_min, w.layout.group_k
    else:
        return None
    return bits / 8 + 4 * (1 + has_min) / group


def teacher_forced(llm, prompts: list[list[int]], tokens: list[list[int]], top: int) -> list:
    """Per prompt: [(greedy token, logprob of the float32 token, float32 token outside the top?)] at every
    position of the float32 continuation, from one request per prompt (prompt + float32 tokens) and its
    prompt logprobs."""
    from jaxpaged import SamplingParams
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p + t} for p, t in zip(prompts, tokens)], sp, use_tqdm=False)
    res = []
    for p, t, o in zip(prompts, tokens, outs):
        rows = []
        for i, want in enumerate(t):
            lp = o.prompt_logprobs[len(p) + i]  # {id: logprob}: the top `top` (best first), then want's
            rows.append((next(iter(lp)), lp[want], len(lp) > top))
        res.append(rows)
    return res


def compare(rows: list, ref: list) -> dict:
    got = [r for p in rows for r in p]
    base = [r for p in ref for r in p]
    want = [w for w, _, _ in base]  # the float32 greedy tokens
    d = np.abs(np.array([g[1] for g in got]) - np.array([b[1] for b in base]))
    return dict(positions=len(got), greedy_agreement=float(np.mean([g[0] == w for g, w in zip(got, want)])),
                mean_abs_dlogprob=float(d.mean()), max_abs_dlogprob=float(d.max()),
                outside_top=int(sum(g[2] for g in got)))


def run(model_dir: str, args, on_row=None) -> dict:
    """The float32 run, then every (weights, KV cache dtype) configuration teacher-forced on its tokens;
    on_row(rows) after each one (the rows so far)."""
    from jaxpaged import SamplingParams
    llm = engine(model_dir, args, "float32", "auto")
    prompts = golden_prompts(llm.tokenizer)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ref = teacher_forced(llm, prompts, tokens, args.top_logprobs)
    del llm
    rows = []
    for w in args.weights:
        for kv in args.kv:
            bc.say(f"weights {w}, KV cache {kv}")
            info = dict(matmul_backend=None, layer_bytes_per_weight=None)
            if (w, kv) == ("float32", "auto"):
                got = ref
            else:
                llm = engine(model_dir, args, w, kv)
                info = dict(matmul_backend=llm.engine.stats()["matmul_backend"],
                            layer_bytes_per_weight=layer_bytes_per_weight(llm))
                got = teacher_forced(llm, prompts, tokens, args.top_logprobs)
                del llm
            rows.append(dict(weights=w, kv_cache_dtype=kv, **info, **compare(got, ref)))
            if on_row is not None:
                on_row(rows)
    return dict(prompts=len(prompts), max_tokens=args.max_tokens, model=model_dir, rows=rows,
                goal_int8_weights_mean_abs_dlogprob=GOAL_INT8_WEIGHTS,
                goal_int4_weights_mean_abs_dlogprob=GOAL_INT4_WEIGHTS, goal_int8_greedy_agreement=GOAL_GREEDY_INT8,
                goal_kv_mean_abs_dlogprob=GOAL_KV)


def provenance(argv: list[str]) -> dict:
    """The command and the git commit of the code that ran (None outside a git checkout)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(command="jaxpaged bench quality " + " ".join(argv), git_commit=commit)


def report(out: dict) -> str:
    rows = [[r["weights"], r["kv_cache_dtype"], r.get("matmul_backend") or "", r.get("layer_bytes_per_weight") or "",
             r["positions"], 100 * r["greedy_agreement"], r["mean_abs_dlogprob"], r["max_abs_dlogprob"],
             r["outside_top"]] for r in out["rows"]]
    return bc.table(rows, ["weights", "KV cache", "products", "bytes / weight", "positions", "greedy agreement %",
                           "mean |dlogprob|", "max |dlogprob|", "outside top"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["float32", "int8", "fp8"], type=_weights_arg,
                    help="[bfloat16-]NAME[:OPTION ...]: NAME float32, bfloat16, int8, int4 or fp8; OPTIONs "
                         f"(quantized names): {OPTIONS} (module docstring)")
    ap.add_argument("--kv", nargs="+", default=["auto"], choices=["auto", "bfloat16", "float8_e4m3fn", "int8"],
                    help="KV cache dtypes, one row each (the engine's kv_cache_dtype)")
    ap.add_argument("--max-tokens", type=int, default=48, help="float32 tokens per golden prompt")
    ap.add_argument("--top-logprobs", type=int, default=20)
    bc.add_engine_args(ap, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=256)
    args = ap.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
    load_before = os.getloadavg()
    command = provenance(sys.argv[1:] if argv is None else argv)

    def partial(rows):  # a long run (a 1B model) leaves the rows so far
        bc.write_json(args.json, dict(partial=True, model=model_dir, rows=rows, **command))
    out = dict(**run(model_dir, args, partial), **command,
               load_average=dict(before=load_before, after=os.getloadavg()), machine=bc.machine_info())
    print(report(out))
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
