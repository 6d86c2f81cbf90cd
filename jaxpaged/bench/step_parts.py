"""Where a decode step's time goes, at 1 and at 64 running requests: the step split into its parts.

    jaxpaged bench step_parts --dtype bfloat16 --running 1 64 --json docs/results/step_parts_bf16.json

One engine (max_num_seqs = the largest --running; any engine flag, e.g. --quantization int8). For each
count N, N requests of --context random prompt tokens run until all of them decode; then --steps decode
steps are timed one by one (`LLMEngine.step`), the compiled call's own time read through the timing seam
(`ModelRunner.wrap_steps`; the call waits for its result), with the process's minor page faults per step
(getrusage). The step of median wall time gives step_ms, and its own call and host (step = host + call;
with --async-scheduling on, the wait inside the call takes away the overlap the engine would have).
The next step is captured and replayed on its inputs (as the engine passes them: the packed buffer from
the host), --repeats pairs of one untraced replay and one under `jax.profiler` (a session each, the pair's
order alternating; jaxpaged/bench/step_profile.py). The parts (ms per step):
  products    the weight products (XLA's dots, the AMX or the quantized C++ kernel), lm_head included
  attention   the paged-attention kernel of every layer
  xla_own     XLA's other thunks: norms, RoPE, the KV writes, gathers, the sampler, copies
  between     no thunk running inside the compiled call: its dispatch, the input copy, waits, wake-ups
  host        the engine step less its compiled call: scheduling, the inputs, reading back, the outputs
  profiler    the tracer's own cost, printed negative: the traced replay of median length less the untraced
              replay of the same rank. It is inside the first four, which split that traced replay whole
              (step_profile.share), in shares the trace cannot tell (a cost per thunk: thunks_per_step
              says how many), so each of them is too high by at most the profiler's line.
host is measured outside the compiled call, between inside it: nothing is counted twice. sum_ms = the five
parts less the profiler; gap_ms = step_ms - sum_ms (gap_pct of the step), which by the above is exactly the
engine's compiled call less the untraced replay: how far the replay differs from the engine's own call
(noise; the engine's call runs right after its host work, a replay after a replay). Nothing is scaled to
fit. Page faults are printed beside them: per step, and their estimated ms (count x the cost of one fault
on fresh memory, measured here); that time is already inside the parts (taken by the kernel that touches
the page).
read_all_weights_ms: a pass that only reads every parameter once, the bound a step's weight reads set.

--prefill P adds a row after each count N: the step in which P new requests of --context random prompt
tokens join the N decoding ones (their prompts chunked within --max-num-batched-tokens beside the decodes:
P = 4 of 128 tokens at N = 0 is a 512-token prefill step, at N = 32 a serving wave's mixed step), timed
over --steps fresh sets of prompts (each set aborted after its step), captured and split the same way;
`tokens` is the tokens such a step computes.

    jaxpaged bench step_parts --dtype bfloat16 --running 0 32 --prefill 4 --steps 3 --repeats 3
"""
from __future__ import annotations

import argparse
import mmap
import os
import re
import statistics
import time

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.bench import timing
from jaxpaged.bench.host import capture_next_step
from jaxpaged.bench.step_profile import KINDS, minor_faults, profile_step

PARTS = (*KINDS, "between", "host")
PAGE = 4096


def fault_cost_us(mib: int = 64, reps: int = 3) -> float:
    """Microseconds per minor page fault on fresh anonymous memory (mapped, then one byte per page
    written: the kernel maps and zeroes each page), the median of `reps` fresh mappings."""
    costs = []
    for _ in range(reps):
        with mmap.mmap(-1, mib << 20) as m:
            a = np.frombuffer(m, np.uint8)
            f, t = minor_faults(), time.perf_counter()
            a[::PAGE] = 1
            t, f = time.perf_counter() - t, minor_faults() - f
            del a
        costs.append(1e6 * t / max(f, 1))
    return statistics.median(costs)


def read_pass():
    """A jitted pass that reads every leaf of a pytree once: a float32 sum of each, but the maximum of a leaf of
    bytes (packed 4- / 8-bit codes), which XLA reads at the memory's rate where a float32 sum would convert every
    byte (measured: 600 MB of uint8, 25 ms for the maximum, 720 ms for the sum)."""
    import jax
    import jax.numpy as jnp

    def read(a):
        if jnp.dtype(a.dtype).itemsize == 1 and a.dtype != jnp.bool_:
            return jnp.max(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(jnp.float32)
        return jnp.sum(a.astype(jnp.float32))
    return jax.jit(lambda t: sum(read(a) for a in jax.tree.leaves(t)))


def read_all_weights_ms(params, repeats: int) -> float:
    """ms of `read_pass` over the parameters (median of `repeats`): the bound a step's weight reads set."""
    return 1e3 * statistics.median(timing.samples(read_pass(), params, reps=repeats))


def fill(eng, n: int, context: int, max_tokens: int, seed: int) -> list[str]:
    """Add n requests of `context` random prompt tokens and step until every one of them decodes."""
    from jaxpaged import SamplingParams
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"parts-{n}-{i}" for i in range(n)]
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": [int(t) for t in rng.integers(3, eng.model_config.vocab_size,
                                                                                  context)]}, sp)
    sch = eng.scheduler
    while sch.waiting or any(r.num_computed_tokens < len(r.token_ids) - 1 for r in sch.running):
        eng.step()
    return ids


def engine_steps(eng, steps: int, before=None, after=None) -> dict:
    """Over `steps` decode steps of the engine (`before` / `after`: called around each one, untimed): the step
    of median wall time, whole: its wall ms, its compiled call's ms and its host ms (the difference); the
    median minor faults per step."""
    calls: list[float] = []

    def timed(key, compiled):
        def step(*args):
            import jax
            t = time.perf_counter()
            out = compiled()(*args)
            jax.block_until_ready(out)
            calls.append(time.perf_counter() - t)
            return out
        return step
    eng.runner.wrap_steps(timed)
    walls, faults = [], []
    try:
        for _ in range(steps):
            if before:
                before()
            f, t = minor_faults(), time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
            faults.append(minor_faults() - f)
            if after:
                after()
    finally:
        eng.runner.wrap_steps(None)
    if len(calls) != steps:
        raise RuntimeError(f"{steps} engine steps ran {len(calls)} compiled calls")
    i = sorted(range(steps), key=walls.__getitem__)[(steps - 1) // 2]  # host and call of the same step
    return dict(step_ms=1e3 * walls[i], call_ms=1e3 * calls[i], host_ms=1e3 * (walls[i] - calls[i]),
                faults_per_step=statistics.median(faults))


def replayed(eng, repeats: int) -> dict:
    """The next decode step captured, then replayed alone on its inputs (those the engine passed from the host
    passed from the host again, so the compiled call copies them in as in the engine): `repeats` pairs of an
    untraced and a traced replay (step_profile.profile_step: the parts, the tracer's own cost)."""
    import jax
    runner = eng.runner
    captured = capture_next_step(runner)
    try:
        eng.step()
    finally:
        runner.wrap_steps(None)
    fn = captured["fn"]
    inputs = jax.tree.map(lambda a, dev: jax.device_put(a) if dev else a, captured["inputs"], captured["on_device"])

    def step():  # the same K/V written again: the engine's state is unchanged
        out, runner.k_pool, runner.v_pool = fn(runner.step_params, runner.k_pool, runner.v_pool, *inputs)
        jax.block_until_ready(out)
    text = fn.as_text()
    module = re.match(r"HloModule ([^\s,]+)", text).group(1)
    host_inputs = sum(not dev for dev in jax.tree.leaves(captured["on_device"]))
    return dict(replay_host_inputs=host_inputs, **profile_step(step, text, module, repeats))


def measure(eng, n: int, args) -> list[dict]:
    """The rows of n running requests: the parts of a decode step (n >= 1), then of the step in which
    --prefill new prompts join them (measure_prefill)."""
    ids = fill(eng, n, args.context, args.max_tokens, args.seed)
    for _ in range(2 if n else 0):
        eng.step()
    rows = [dict(running=n, **engine_steps(eng, args.steps), **replayed(eng, args.repeats))] if n else []
    if args.prefill:
        rows.append(measure_prefill(eng, n, args))
    if len(eng.scheduler.running) != n:
        raise SystemExit(f"running={n}: requests finished during the timed steps; raise --max-model-len")
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    for row in rows:
        row["sum_ms"] = sum(row[f"{p}_ms"] for p in PARTS) - row["profiler_ms"]
        row["gap_ms"] = row["step_ms"] - row["sum_ms"]  # = call_ms - replay_ms
        row["gap_pct"] = 100 * row["gap_ms"] / row["step_ms"]
        row["fault_ms"] = row["faults_per_step"] * args.fault_cost_us / 1e3
        ratios = sorted(w / u for u, w in row["pairs_ms"])  # traced / untraced replay, pair by pair
        bc.say(f"{label(row)}: step {row['step_ms']:.2f} ms, parts less profiler {row['sum_ms']:.2f} ms "
               f"(profiler {row['profiler_ms']:.2f} ms; traced / untraced replay, pair by pair: median "
               f"{statistics.median(ratios):.3f}, {ratios[0]:.3f}-{ratios[-1]:.3f}), gap {row['gap_pct']:+.1f} %")
    return rows


def label(row: dict) -> str:
    """A row's name: its running count, and the prompts that join them."""
    return f"{row['running']} running" + (f" + {row['prefill']} prompts" if "prefill" in row else "")


def computed(eng) -> int:
    """Tokens with K/V in the pool, over every running request."""
    return sum(r.num_computed_tokens for r in eng.scheduler.running)


def measure_prefill(eng, n: int, args) -> dict:
    """A row: the step in which args.prefill new prompts join the n decoding requests (module docstring)."""
    from jaxpaged import SamplingParams
    rng = np.random.default_rng(args.seed + 1)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    sets, ids, tokens = iter(range(args.steps + 1)), [], []

    def add():  # a set of fresh random prompts (no prefix-cache hit between sets)
        i = next(sets)
        ids[:] = [f"prefill-{n}-{i}-{j}" for j in range(args.prefill)]
        for rid in ids:
            eng.add_request(rid, {"prompt_token_ids": [int(t) for t in rng.integers(3, eng.model_config.vocab_size,
                                                                                      args.context)]}, sp)
        tokens.append(computed(eng))

    def drop():  # the tokens the step computed; the set aborted, the n decoding requests go on
        tokens[-1] = computed(eng) - tokens[-1]
        for rid in ids:
            eng.abort_request(rid)
    row = dict(running=n, prefill=args.prefill, **engine_steps(eng, args.steps, before=add, after=drop))
    add()
    row.update(replayed(eng, args.repeats))
    drop()
    row["tokens"] = statistics.median(tokens)
    return row


def report(rows: list[dict]) -> str:
    """The parts as rows, one ms and % of the step column pair per running count; the profiler's line is
    negative: its cost is inside the four parts before host, and the sum leaves it out."""
    def line(name, key, sign=1, share=True):
        return [name, *[c for r in rows for c in (sign * r[key], f"{100 * sign * r[key] / r['step_ms']:.1f}%"
                                                   if share else "")]]
    lines = [line("step", "step_ms"), *[line(p, f"{p}_ms") for p in PARTS],
             line("profiler (inside the above)", "profiler_ms", -1), line("sum", "sum_ms"), line("gap", "gap_ms")]
    faults = [c for r in rows for c in (r["fault_ms"], f"{r['faults_per_step']:.0f}/step")]
    lines.append(["page faults (inside)", *faults])
    lines += [line("call in the engine", "call_ms", share=False), line("replay untraced", "replay_ms", share=False),
              line("replay traced", "window_ms", share=False)]
    return bc.table(lines, ["ms per step", *[h for r in rows for h in (label(r), "share")]])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[1, 64], help="running requests of each row")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="engine decode steps timed per row")
    ap.add_argument("--repeats", type=int, default=10, help="replays of the captured step, untraced and traced")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also the step in which this many new prompts join each running count (0: none)")
    bc.add_engine_args(ap, max_num_batched_tokens=512)
    args = ap.parse_args(argv)
    if min(args.running) < (0 if args.prefill else 1) or args.steps < 1 or args.repeats < 1 or args.context < 1:
        raise SystemExit("--steps, --repeats, --context and --running must be >= 1 (--running >= 0 with --prefill)")
    if args.prefill < 0:
        raise SystemExit(f"--prefill must be >= 0, got {args.prefill}")
    top = max(args.running)
    budget = max(args.max_num_batched_tokens, 2 * top)
    # the fill, 2 + steps + capture, and the prefill row's steps + capture
    args.max_tokens = top * args.context // max(budget - top, 1) + 2 * args.steps + 16
    max_len = args.max_model_len or args.context + args.max_tokens + args.block_size
    blocks = args.num_kv_blocks or top * -(-max_len // args.block_size) + args.prefill * -(
        -(args.context + 2) // args.block_size) + 1
    args.fault_cost_us = fault_cost_us()
    llm = bc.build_llm(bc.resolve_model(args.model), args, max_num_seqs=max(args.max_num_seqs, top + args.prefill),
                       max_num_batched_tokens=budget, max_model_len=max_len, num_kv_blocks=blocks)
    eng = llm.engine
    rows = [row for n in args.running for row in measure(eng, n, args)]
    import jax
    out = dict(**bc.run_info("step_parts", argv), results=rows, model=args.model or "default", dtype=args.dtype,
               quantization=args.quantization, matmul_backend=eng.runner.matmul_backend,
               attention_backend=eng.runner.backend, context=args.context, fault_cost_us=args.fault_cost_us,
               read_all_weights_ms=read_all_weights_ms(eng.runner.params, args.repeats),
               weight_bytes=int(sum(a.nbytes for a in jax.tree.leaves(eng.runner.params))),
               load_average=os.getloadavg(), machine=bc.machine_info(),
               note="step = host + call in the engine; products + attention + xla_own + between = the traced replay; "
                    "profiler = traced less untraced replay; sum = the parts less profiler; gap = call less replay")
    print(report(rows))
    print(f"read all weights once: {out['read_all_weights_ms']:.2f} ms; one page fault: {args.fault_cost_us:.2f} us")
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
