"""Start-up: cold vs warm time to first token, each in a fresh process.

    jaxpaged bench startup --warm-runs 2 --json results/startup.json

A child process imports jaxpaged, builds the engine (loads the weights, compiles every step shape)
and generates one token for a short prompt. Time to first token is measured from just before the
child is spawned (interpreter start and imports included) to that token.
  cold: the compilation cache directory is new and empty (--cache-root, a fresh subdirectory);
  warm: the same directory again, filled by the cold run.
The model is converted beforehand (`jaxpaged fetch-default`); conversion is not part of either.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from jaxpaged.bench import common as bc


def child(args) -> None:
    t_spawn = args.spawned_at
    t0 = time.time()
    from jaxpaged import LLM, SamplingParams
    t_import = time.time()
    llm = LLM(model=args.model, **bc.engine_kwargs(args, compilation_cache_dir=args.cache_dir))
    t_engine = time.time()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}], SamplingParams(max_tokens=1),
                       use_tqdm=False)
    t_first = time.time()
    assert len(out[0].outputs[0].token_ids) == 1
    st = llm.stats()
    print("STARTUP " + json.dumps(dict(
        time_to_first_token_s=t_first - t_spawn, interpreter_s=t0 - t_spawn, import_s=t_import - t0,
        engine_s=t_engine - t_import, load_s=st["load_seconds"], compile_s=st["compile_seconds"],
        num_compilations=st["num_compilations"], first_token_s=t_first - t_engine)), flush=True)


def spawn(args, model_dir: str, cache_dir: str) -> dict:
    argv = [sys.executable, "-m", "jaxpaged.bench.startup", "--child", "--model", model_dir, "--cache-dir", cache_dir,
            "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
            "--attention-backend", args.attention_backend, "--seed", str(args.seed)]
    for flag, v in (("--max-model-len", args.max_model_len), ("--num-kv-blocks", args.num_kv_blocks)):
        if v is not None:
            argv += [flag, str(v)]
    t = time.time()
    proc = subprocess.run(argv + ["--spawned-at", repr(t)], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")]
    if proc.returncode or not lines:
        raise SystemExit(f"start-up child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("STARTUP "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--cache-root", default=None, help="where the fresh cache directory is made (default: a temp dir)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    bc.add_engine_args(ap, max_model_len=2048)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}

    model_dir = bc.resolve_model(args.model)
    if args.cache_root:
        os.makedirs(args.cache_root, exist_ok=True)
    cache_dir = tempfile.mkdtemp(prefix="jaxpaged-startup-", dir=args.cache_root)
    bc.say(f"cold start (empty compilation cache {cache_dir})")
    cold = spawn(args, model_dir, cache_dir)
    warm = []
    for i in range(args.warm_runs):
        bc.say(f"warm start {i + 1}/{args.warm_runs}")
        warm.append(spawn(args, model_dir, cache_dir))
    ttft = [w["time_to_first_token_s"] for w in warm]
    out = dict(model=model_dir, cache_dir=cache_dir, cold=cold, warm=warm,
               warm_median_time_to_first_token_s=statistics.median(ttft) if ttft else None,
               engine={k: v for k, v in bc.engine_kwargs(args).items() if k != "show_progress"},
               machine=bc.machine_info())
    print(report(out))
    bc.write_json(args.json, out)
    return out


def report(out: dict) -> str:
    keys = ["time_to_first_token_s", "interpreter_s", "import_s", "engine_s", "load_s", "compile_s", "first_token_s"]
    runs = [("cold", out["cold"])] + [(f"warm {i + 1}", w) for i, w in enumerate(out["warm"])]
    rows = [[name] + [r[k] for k in keys] for name, r in runs]
    return bc.table(rows, ["start", "to first token s", "interpreter s", "import s", "engine s", "  of which load s",
                           "  of which compile s", "first token s"])


if __name__ == "__main__":
    main()
