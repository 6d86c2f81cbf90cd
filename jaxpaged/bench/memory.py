"""KV memory under a fixed budget: the paged pool against a contiguous allocation, and prefix sharing.

    jaxpaged bench memory --num-kv-blocks 1024 --max-model-len 2048 --json results/memory.json

The engine runs each workload to completion with a pool of --num-kv-blocks blocks; after every step the
block manager's counters are sampled (no timing). Reported:
  - paged: blocks in use vs tokens whose K/V they hold, at the step of peak use (of several equal
    ones, the fullest; waste % = unfilled positions in used blocks) and averaged over steps; the peak number of
    running requests; preemptions.
  - contiguous: the same workload replayed through a contiguous allocator with the same budget, which
    must reserve max_model_len positions per request when it admits it (a non-paged engine that does
    not know output lengths), and an oracle variant that reserves exactly prompt + max_tokens. It
    prefills a prompt in one step and then adds one token per step, as the engine does; its token
    budget per step is not limited (in its favour).
  - sharing: with n > 1 samples per request, and with a shared system prompt (prefix caching on), the
    blocks in use against the blocks the same requests would hold without sharing (the sum of each
    request's block list).
Block counts do not depend on the weights (EOS is ignored, lengths are drawn): `--model random:tiny`
gives the same figures in seconds.

Weights (--weight-formats, default float32 int8 fp8; --weights-only skips the KV workloads): for each
format a fresh process loads the model (`quantization=`; the same engine settings) and reports the
parameter bytes on the device, the KV pool bytes, and its resident set (RSS) before loading, right after
loading (no step compiled yet) and after compiling every step shape; the goal of issue 14 is int8
parameter bytes <= 30% of float32 and RSS after load <= int8 parameters + KV pool + 300 MB.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import deque

import numpy as np

from jaxpaged.bench import common as bc


class Sampler:
    """Per-step samples of the pool: blocks in use, tokens held, what no sharing would need."""

    def __init__(self):
        self.used, self.held, self.unshared, self.running = [], [], [], []

    def __call__(self, engine):
        bm, bs = engine.block_manager, engine.block_manager.block_size
        fill: dict[int, int] = {}  # block id -> filled positions (a shared block counts once)
        unshared = 0
        for req in engine.scheduler.running:
            unshared += len(req.block_ids)
            for i, b in enumerate(req.block_ids):
                fill[b] = max(fill.get(b, 0), min(bs, req.num_computed_tokens - i * bs))
        self.used.append(bm.num_used_blocks)
        self.held.append(sum(max(f, 0) for f in fill.values()))
        self.unshared.append(unshared)
        self.running.append(len(engine.scheduler.running))

    def summary(self, block_size: int) -> dict:
        used, held = np.asarray(self.used), np.asarray(self.held)
        peak = _peak(used, held)
        busy = used > 0
        return dict(steps=len(used), peak_used_blocks=int(used[peak]), peak_used_tokens=int(used[peak] * block_size),
                    tokens_held_at_peak=int(held[peak]),
                    waste_pct_at_peak=100 * (1 - held[peak] / max(1, used[peak] * block_size)),
                    mean_waste_pct=float(100 * np.mean(1 - held[busy] / (used[busy] * block_size))),
                    peak_running=int(max(self.running, default=0)),
                    peak_unshared_blocks=int(max(self.unshared, default=0)),
                    saved_pct_at_peak=100 * (1 - used.max() / max(1, max(self.unshared, default=0))),
                    saved_pct_block_steps=100 * (1 - used.sum() / max(1, sum(self.unshared))))

    def series(self, block_size: int) -> dict:
        return dict(used_tokens=[u * block_size for u in self.used], held_tokens=self.held, running=self.running)


def _peak(allocated: np.ndarray, held: np.ndarray) -> int:
    """The step of peak allocation; among equal ones, the one holding the most tokens (least waste)."""
    return int(np.lexsort((held, allocated))[-1])


def simulate_contiguous(reqs: list[bc.Req], budget_tokens: int, max_num_seqs: int, reserve) -> tuple[dict, dict]:
    """Contiguous allocation: FCFS admission while a slot and reserve(req) positions are free; each
    admitted sample holds its prompt after one step and one more token per step after that."""
    queue = deque((len(r.prompt_ids), r.output_len, reserve(r)) for r in reqs for _ in range(r.n))
    running = []  # [prompt_len, output_len, reserved, tokens computed]
    series = dict(reserved_tokens=[], held_tokens=[], running=[])
    while queue or running:
        while queue and len(running) < max_num_seqs and \
                sum(r[2] for r in running) + queue[0][2] <= budget_tokens:
            running.append(list(queue.popleft()) + [0])
        if not running:
            raise SystemExit(f"a request needs {queue[0][2]} positions, more than the budget {budget_tokens}")
        for r in running:
            r[3] = r[0] if r[3] == 0 else r[3] + 1
        series["reserved_tokens"].append(sum(r[2] for r in running))
        series["held_tokens"].append(sum(r[3] for r in running))
        series["running"].append(len(running))
        running = [r for r in running if r[3] - r[0] + 1 < r[1]]  # the last output token is never computed
    res, held = np.asarray(series["reserved_tokens"]), np.asarray(series["held_tokens"])
    peak = _peak(res, held)
    return dict(steps=len(res), peak_reserved_tokens=int(res[peak]), tokens_held_at_peak=int(held[peak]),
                waste_pct_at_peak=100 * (1 - held[peak] / res[peak]),
                mean_waste_pct=float(100 * np.mean(1 - held / res)),
                peak_running=int(max(series["running"]))), series


def run(engine, wl: bc.Workload) -> Sampler:
    s = Sampler()
    p0 = engine.scheduler.num_preemptions
    bc.drive(engine, wl.requests, on_step=s)
    s.preemptions = engine.scheduler.num_preemptions - p0
    engine.block_manager.reset_prefix_cache()
    return s


def weights_child(model_dir: str, args) -> dict:
    """In a fresh process: RSS before and after loading `args.weights_child` weights, and after compiling."""
    import psutil
    proc = psutil.Process()
    import jaxpaged.engine  # noqa: F401  (imports are not the model's memory)
    before = proc.memory_info().rss
    fmt = None if args.weights_child == "float32" else args.weights_child
    llm = bc.build_llm(model_dir, args, quantization=fmt, warmup=False)
    mem = llm.engine.runner.memory_per_device()
    loaded = proc.memory_info().rss
    llm.engine.runner.warmup(False)
    return dict(weights=args.weights_child, param_bytes=mem["param_bytes_per_device"],
                kv_pool_bytes=mem["kv_bytes_per_device"], rss_before_load=before, rss_after_load=loaded,
                rss_after_compile=proc.memory_info().rss, load_seconds=llm.engine.load_seconds)


def weights_memory(model_dir: str, args, argv: list[str]) -> dict:
    """One fresh process per weight format (see the module docstring); the goal checks against int8."""
    rows = {}
    for fmt in args.weight_formats:
        bc.say(f"weights {fmt}: loading in a fresh process")
        p = subprocess.run([sys.executable, "-m", "jaxpaged.bench.memory", *argv, "--model", model_dir,
                            "--weights-child", fmt], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"weights {fmt}: the child process failed:\n{p.stderr[-3000:]}")
        rows[fmt] = json.loads(p.stdout.strip().splitlines()[-1])
    out = dict(formats=rows)
    if "float32" in rows and "int8" in rows:
        i8 = rows["int8"]
        out["int8_over_float32"] = i8["param_bytes"] / rows["float32"]["param_bytes"]
        out["int8_rss_over_budget_mb"] = (i8["rss_after_load"] - i8["param_bytes"] - i8["kv_pool_bytes"]) / 1e6
    return out


def weights_report(w: dict) -> str:
    mb = 1e6
    rows = [[f, r["param_bytes"] / mb, r["kv_pool_bytes"] / mb, r["rss_before_load"] / mb, r["rss_after_load"] / mb,
             (r["rss_after_load"] - r["param_bytes"] - r["kv_pool_bytes"]) / mb, r["rss_after_compile"] / mb]
            for f, r in w["formats"].items()]
    t = bc.table(rows, ["weights", "params MB", "KV pool MB", "RSS before load MB", "RSS after load MB",
                        "RSS - params - KV MB", "RSS after compile MB"])
    if "int8_over_float32" in w:
        t += (f"\nint8 / float32 parameter bytes: {100 * w['int8_over_float32']:.1f}% (goal <= 30%); int8 RSS "
              f"after load - params - KV pool: {w['int8_rss_over_budget_mb']:.0f} MB (goal <= 300 MB)")
    return t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_workload_args(ap, num_prompts=128, prompt_len=(32, 256), output_len=(16, 256))
    g = ap.add_argument_group("sharing workloads")
    g.add_argument("--n", type=int, default=4, help="samples per request in the n > 1 workload")
    g.add_argument("--n-prompts", type=int, default=16, help="requests in the n > 1 workload")
    g.add_argument("--system-len", type=int, default=512, help="shared system prompt tokens")
    g.add_argument("--system-prompts", type=int, default=32, help="requests in the system-prompt workload")
    g.add_argument("--question-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    g = ap.add_argument_group("weights")
    g.add_argument("--weight-formats", nargs="*", default=["float32", "int8", "fp8"],
                   choices=["float32", "int8", "fp8"], help="weight formats to load (each in a fresh process)")
    g.add_argument("--weights-only", action="store_true", help="only the weights section")
    g.add_argument("--weights-child", default=None, help=argparse.SUPPRESS)
    bc.add_engine_args(ap, max_model_len=2048, num_kv_blocks=1024)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)

    model_dir = bc.resolve_model(args.model)
    if args.weights_child:
        print(json.dumps(weights_child(model_dir, args)))
        return {}
    weights = weights_memory(model_dir, args, argv) if args.weight_formats else None
    if args.weights_only:
        out = dict(weights=weights, model=model_dir, machine=bc.machine_info())
        print(weights_report(weights))
        bc.write_json(args.json, out)
        return out
    llm = bc.build_llm(model_dir, args, enable_prefix_caching=True)
    eng = llm.engine
    bs, L = eng.block_manager.block_size, eng.max_model_len
    budget_blocks = eng.num_blocks - 1
    from jaxpaged.step.runner import kv_bytes_per_block
    budget = dict(num_kv_blocks=budget_blocks, block_size=bs, tokens=budget_blocks * bs, max_model_len=L,
                  max_num_seqs=eng.config.max_num_seqs,
                  gib=budget_blocks * kv_bytes_per_block(eng.model_config, bs, args.dtype) / 2 ** 30)

    main_wl = bc.make_workload(args, model_dir)
    bc.say(f"paged: {len(main_wl.requests)} requests, {budget_blocks} blocks")
    paged = run(eng, main_wl)
    contiguous, c_series = simulate_contiguous(main_wl.requests, budget["tokens"], eng.config.max_num_seqs,
                                               lambda r: L)
    oracle, _ = simulate_contiguous(main_wl.requests, budget["tokens"], eng.config.max_num_seqs,
                                    lambda r: len(r.prompt_ids) + r.output_len)

    n_wl = bc.make_workload(args, model_dir, num_prompts=args.n_prompts, n=args.n, seed_offset=1)
    bc.say(f"n = {args.n}: {args.n_prompts} requests")
    n_run = run(eng, n_wl)
    sys_args = argparse.Namespace(**{**vars(args), "prompt_len": args.question_len})
    sys_wl = bc.make_workload(sys_args, model_dir, num_prompts=args.system_prompts, prefix_len=args.system_len,
                              seed_offset=2)
    bc.say(f"system prompt of {args.system_len} tokens: {args.system_prompts} requests")
    sys_run = run(eng, sys_wl)

    out = dict(workload=main_wl.info, budget=budget, model=model_dir,
               paged=dict(paged.summary(bs), num_preemptions=paged.preemptions),
               contiguous_max_model_len=contiguous, contiguous_oracle=oracle,
               sharing=dict(n=dict(workload=n_wl.info, **n_run.summary(bs), num_preemptions=n_run.preemptions),
                            system_prompt=dict(workload=sys_wl.info, **sys_run.summary(bs),
                                               num_preemptions=sys_run.preemptions)),
               series=dict(paged=paged.series(bs), contiguous=c_series), machine=bc.machine_info(), weights=weights)
    print(report(out) + ("\n\n" + weights_report(weights) if weights else ""))
    bc.write_json(args.json, out)
    return out


def report(out: dict) -> str:
    b, p, c, o = out["budget"], out["paged"], out["contiguous_max_model_len"], out["contiguous_oracle"]
    rows = [["paged", p["peak_used_tokens"], p["tokens_held_at_peak"], p["waste_pct_at_peak"], p["mean_waste_pct"],
             p["peak_running"]],
            [f"contiguous (max_model_len {b['max_model_len']})", c["peak_reserved_tokens"], c["tokens_held_at_peak"],
             c["waste_pct_at_peak"], c["mean_waste_pct"], c["peak_running"]],
            ["contiguous (oracle: prompt + max_tokens)", o["peak_reserved_tokens"], o["tokens_held_at_peak"],
             o["waste_pct_at_peak"], o["mean_waste_pct"], o["peak_running"]]]
    t1 = bc.table(rows, ["allocation", "peak positions", "tokens held", "waste % at peak", "mean waste %",
                         "peak running"])
    sh = out["sharing"]
    rows = [[f"n = {sh['n']['workload']['n']}", sh["n"]["peak_used_blocks"], sh["n"]["peak_unshared_blocks"],
             sh["n"]["saved_pct_at_peak"], sh["n"]["saved_pct_block_steps"]],
            [f"system prompt {sh['system_prompt']['workload']['shared_prefix_len']} tokens",
             sh["system_prompt"]["peak_used_blocks"], sh["system_prompt"]["peak_unshared_blocks"],
             sh["system_prompt"]["saved_pct_at_peak"], sh["system_prompt"]["saved_pct_block_steps"]]]
    t2 = bc.table(rows, ["sharing", "peak blocks", "peak blocks unshared", "saved % at peak", "saved % block-steps"])
    return (f"KV budget: {b['num_kv_blocks']} blocks x {b['block_size']} = {b['tokens']} positions "
            f"({b['gib']:.2f} GiB); paged preemptions: {p['num_preemptions']}\n{t1}\n\n{t2}")


if __name__ == "__main__":
    main()
