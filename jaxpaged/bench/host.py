"""Host overhead per decode step, and decode efficiency against a plain matmul microbenchmark.

    jaxpaged bench host --running 8 64 128 256 --json results/host.json
    jaxpaged bench host --null-device --running 8 64 256 --json results/host_null.json

--null-device: the runner's compiled step is replaced by one that only moves the step's inputs to the
device and returns fixed fake tokens at once, through the same engine code. Then the whole step is host
time: host_ms_per_step, null_steps_per_s (the ceiling of any accelerator's decode step rate under this
host), split into schedule / prepare / transfer / update / detokenize (the rest of LLMEngine.step:
stop checks, detokenization, outputs), medians of --repeats runs of --steps steps; also the process's
CPU time per step (less disturbed than wall time by other processes on a shared machine). Requests
stream (an output every step, as the server's) unless --final-only (as LLM.generate). With
--device-ms D every step takes D ms on a simulated in-order device that uses no CPU (SimulatedDevice):
unhidden_host_ms_per_step = wall time per step - D is the host time the device waits for (with async
scheduling, what the overlap does not hide).

For each count N of running requests, an engine with max_num_seqs = N (and a token budget of at least
2N) is filled with N requests (distinct random prompts of --context tokens; early ones decode while
later ones prefill) until all of them decode; then --steps decode steps are
timed one by one, with the engine's own calls wrapped by timers:
  schedule      Scheduler.schedule
  execute       ModelRunner.launch + ModelRunner.read: input arrays + device step + reading the results back
  update        Scheduler.update_from_output
  engine        the rest of LLMEngine.step (stop checks, detokenization, outputs)
The device time of the same step is measured on its own afterwards: the step's compiled function is
replayed on the step's inputs, already on the device, until ready. Host overhead = step wall time -
device time (the host time not hidden behind the device), as a share of the step wall time; also as
unhidden_host_ms_per_step. With --async-scheduling on, step t+1 is prepared while step t runs.

Decode efficiency = model FLOPs of the step (2 x matmul parameters per token, logits included, plus
4 x layers x heads x head_dim x context for attention) / step wall time, divided by the FLOP rate of a
plain jitted chain of jnp.dot at the same shapes ([N, hidden] through every layer's projections and
the logits), same dtype, measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.bench import roofline, timing


class Timed:
    """Wraps a bound method (set on the instance, so the engine's own calls go through it)."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.fn, self.times = obj, name, getattr(obj, name), []
        setattr(obj, name, self)

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.times.append(time.perf_counter() - t)

    def remove(self):
        delattr(self.obj, self.name)


def capture_next_step(runner) -> dict:
    """Make the runner's steps record their compiled function and inputs (ModelRunner.wrap_steps) until
    `runner.wrap_steps()` is called again; return the record, filled by the next step: fn, inputs (host
    copies) and on_device (per input: whether the step was given it on the device, not from the host)."""
    captured = {}

    def capture(key, compiled):
        def step(params, k, v, *inputs):
            import jax
            fn = compiled()
            captured.update(fn=fn, inputs=jax.tree.map(np.array, inputs),
                            on_device=jax.tree.map(lambda a: isinstance(a, jax.Array), inputs))
            return fn(params, k, v, *inputs)
        return step

    runner.wrap_steps(capture)
    return captured


def replay(runner, captured: dict, reps: int) -> list[float]:
    """Seconds of each replay of the captured step on its inputs, already on the device (device only)."""
    import jax
    fn = captured["fn"]
    inputs = jax.device_put(captured["inputs"])

    def step():  # the same K/V are written again: the engine's state is unchanged
        out, runner.k_pool, runner.v_pool = fn(runner.params, runner.k_pool, runner.v_pool, *inputs)
        return out
    return timing.samples(step, reps=reps)


def null_step(S: int, num_logprobs: int, vocab_size: int):
    """A compiled-step stand-in with the step's signature: takes the same inputs (so they are moved to
    the device by the same call), computes nothing, returns fixed fake tokens (never EOS: ignore_eos).
    The tokens are ordinary ones from the middle of the vocabulary: a special token decodes to nothing
    and makes the detokenizer's window grow, a cost that real text does not have."""
    import jax
    import jax.numpy as jnp
    first = min(1000, vocab_size // 2)

    def fn(params, k, v, *inputs):
        tokens = jnp.arange(S, dtype=jnp.int32) % min(97, vocab_size - first) + first
        return ((tokens, jnp.zeros(S, jnp.float32), jnp.zeros((S, num_logprobs), jnp.float32),
                 jnp.zeros((S, num_logprobs), jnp.int32)), ()), k, v  # no prompt logprobs asked
    return jax.jit(fn, donate_argnums=(1, 2))


class SimulatedDevice:
    """An in-order device whose every step takes `seconds` (--device-ms): a step starts when it is
    launched and the previous one has ended; its outputs become `Pending` arrays, whose reading waits
    for the step's end (sleeping, then spinning the last 0.2 ms for precision). No CPU is used meanwhile,
    as with an accelerator, so the host time not hidden behind the device is wall time - `seconds`."""

    def __init__(self, seconds: float):
        self.seconds, self.free_at = seconds, 0.0

    def run(self, outputs):
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        return tuple(Pending(a, self.free_at) for a in outputs)


class Pending:
    """An output array of a simulated step (see SimulatedDevice)."""

    def __init__(self, array, ready_at: float):
        self.array, self.ready_at = array, ready_at

    def __array__(self, dtype=None, copy=None):
        wait = self.ready_at - time.perf_counter()
        if wait > 2e-4:
            time.sleep(wait - 2e-4)
        while time.perf_counter() < self.ready_at:
            pass
        return np.asarray(self.array, dtype)


def measure_null(model_dir: str, args, N: int) -> dict:
    """Host time per decode step with a device step that returns at once (see --null-device)."""
    budget = max(2 * N, args.max_num_batched_tokens)
    fill_steps = -(-N * args.context // (budget - N)) + 2  # early requests decode while later ones prefill
    total = fill_steps + args.warmup_steps + args.repeats * args.steps + 4
    max_len = args.max_model_len or args.context + total + 8
    per_seq = -(-max_len // args.block_size)
    llm = bc.build_llm(model_dir, args, max_num_seqs=N, max_num_batched_tokens=budget, max_model_len=max_len,
                       num_kv_blocks=args.num_kv_blocks or N * per_seq + 1, warmup=False, **async_kw(args))
    eng, runner, sch = llm.engine, llm.engine.runner, llm.engine.scheduler
    fake = null_step(N, runner.num_logprobs, eng.model_config.vocab_size)
    device = SimulatedDevice(args.device_ms / 1e3) if args.device_ms else None
    transfer: list[float] = []

    def timed_fake(params, k, v, packed, extra):  # the call moves the step's host inputs to the device
        t = time.perf_counter()
        try:
            if device is None:
                return fake(params, k, v, packed, extra)
            extra = {n: a.array if isinstance(a, Pending) else a for n, a in extra.items()}
            (sampled, prompt), k, v = fake(params, k, v, packed, extra)
            return (device.run(sampled), prompt), k, v
        finally:
            transfer.append(time.perf_counter() - t)
    runner.wrap_steps(lambda key, compiled: timed_fake)  # the real step is never compiled
    rng = np.random.default_rng(args.seed)
    from jaxpaged import SamplingParams
    vocab = eng.model_config.vocab_size
    for i in range(N):
        sp = SamplingParams(max_tokens=max_len - args.context, temperature=0.0, ignore_eos=True,
                            stop=stop_strings(args.stop_strings))
        eng.add_request(f"h{i}", [int(t) for t in rng.integers(3, vocab, args.context)], sp,
                        **({"stream": False} if args.final_only else {}))
    while sch.waiting or any(r.num_computed_tokens < len(r.token_ids) - 1 for r in sch.running):
        eng.step()
    for _ in range(args.warmup_steps):
        eng.step()
    parts = [(o, n) for o, n in ((sch, "schedule"), (getattr(runner, "batch", None), "prepare"),
                                 (runner, "device_inputs"), (runner, "read"), (sch, "update_from_output"),
                                 (eng.outputs, "process")) if hasattr(o, n)]
    if not hasattr(runner, "launch"):  # before the persistent batch
        parts.append((runner, "execute"))
    reps = []
    for _ in range(args.repeats):
        timers = {n: Timed(o, n) for o, n in parts}
        transfer.clear()
        walls, cpus = [], []
        for _ in range(args.steps):
            t, c = time.perf_counter(), time.process_time()
            eng.step()
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        for tm in timers.values():
            tm.remove()
        if len(sch.running) != N:
            raise SystemExit(f"N={N}: requests finished during the timed steps; raise --max-model-len")
        med = {n: statistics.median(tm.times) for n, tm in timers.items()}
        wall, xfer = statistics.median(walls), statistics.median(transfer)
        run = med.get("execute", 0.0)
        rep = dict(host_ms_per_step=1e3 * wall, host_cpu_ms_per_step=1e3 * statistics.median(cpus),
                   # a simulated device catches up after a host stall: some steps look short, so the mean
                   unhidden_host_ms_per_step=1e3 * (statistics.mean(walls) if device else wall) - args.device_ms,
                   schedule_ms=1e3 * med["schedule"],
                   transfer_ms=1e3 * xfer, update_ms=1e3 * med["update_from_output"])
        if "prepare" in med:  # the persistent batch: prepare, pack (+ transfer), read back
            rep["prepare_ms"] = 1e3 * med["prepare"]
            rep["transfer_ms"] += 1e3 * med["device_inputs"]
            rep["readback_ms"] = 1e3 * med["read"]
            rep["detokenize_ms"] = 1e3 * med["process"]
        else:  # before the persistent batch: execute = prepare + transfer + reading back
            rep["prepare_ms"] = 1e3 * (run - xfer)
            rep["detokenize_ms"] = 1e3 * (wall - med["schedule"] - run - med["update_from_output"])
        reps.append(rep)
    res = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    res = dict(running=N, **res, null_steps_per_s=1e3 / res["host_ms_per_step"],
               async_scheduling=getattr(eng, "async_scheduling", False), repeats=reps)
    bc.say(f"N={N}: host {res['host_ms_per_step']:.3f} ms/step, {res['null_steps_per_s']:.0f} null steps/s")
    return res


def stop_strings(kind: str | None) -> list[str] | None:
    """Stop strings that never match (--stop-strings): one; or at the bound of SamplingParams, as
    MAX_STOP_STRINGS strings of equal length ("max") or one long string and one-character ones ("long"),
    MAX_STOP_CHARS characters in all either way."""
    from jaxpaged.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
    if kind is None:
        return None
    if kind == "one":
        return ["never seen: stop string"]
    if kind == "max":
        return [f"never seen {i:02d}:".ljust(MAX_STOP_CHARS // MAX_STOP_STRINGS, "~") for i in range(MAX_STOP_STRINGS)]
    short = [chr(0xE000 + i) for i in range(MAX_STOP_STRINGS - 1)]  # private-use characters: never in the text
    return short + ["never seen:".ljust(MAX_STOP_CHARS - len(short), "~")]


def matmul_times(mc, rows: int, dtype: str, reps: int) -> list[float]:
    """Seconds of each run of the model's projections and logits as plain jnp.dot calls on [rows, hidden]."""
    import jax
    import jax.numpy as jnp
    D, F, V = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = dict(wq=(D, q), wk=(D, kv), wv=(D, kv), wo=(q, D), w_gate=(D, F), w_up=(D, F), w_down=(F, D))
    keys = iter(jax.random.split(jax.random.key(0), 8 * mc.num_layers + 2))
    layers = [{n: 0.02 * jax.random.normal(next(keys), s, dtype) for n, s in shapes.items()}
              for _ in range(mc.num_layers)]
    head = 0.02 * jax.random.normal(next(keys), (D, V), dtype)
    x = jax.random.normal(next(keys), (rows, D), dtype)

    @jax.jit
    def chain(x, layers, head):
        for p in layers:
            a = jnp.dot(x, p["wq"])
            k, v = jnp.dot(x, p["wk"]), jnp.dot(x, p["wv"])
            g = jnp.dot(x, p["w_gate"]) * jnp.dot(x, p["w_up"])
            x = x + jnp.dot(a, p["wo"]) + jnp.dot(g, p["w_down"]) + (k.sum() + v.sum()).astype(x.dtype)
        return jnp.dot(x, head, preferred_element_type=jnp.float32)

    return timing.samples(chain, x, layers, head, reps=reps)


def matmul_params(mc) -> int:
    D, F, V = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return mc.num_layers * (2 * D * q + 2 * D * kv + 3 * D * F) + D * V


def async_kw(args) -> dict:
    return {} if args.async_scheduling == "auto" else dict(async_scheduling=args.async_scheduling == "on")


def measure(model_dir: str, args, N: int) -> dict:
    budget = max(2 * N, args.max_num_batched_tokens)
    fill_steps = -(-N * args.context // (budget - N)) + 2  # early requests decode while later ones prefill
    max_len = args.max_model_len or args.context + fill_steps + args.warmup_steps + args.steps + 8
    per_seq = -(-max_len // args.block_size)
    llm = bc.build_llm(model_dir, args, max_num_seqs=N, max_num_batched_tokens=budget, max_model_len=max_len,
                       num_kv_blocks=args.num_kv_blocks or N * per_seq + 1, warmup=False, **async_kw(args))
    eng = llm.engine
    mc = eng.model_config
    rng = np.random.default_rng(args.seed)
    from jaxpaged import SamplingParams
    sp = SamplingParams(max_tokens=max_len - args.context, temperature=0.0, ignore_eos=True)
    for i in range(N):
        eng.add_request(f"h{i}", [int(t) for t in rng.integers(3, mc.vocab_size, args.context)], sp)
    sch = eng.scheduler
    bc.say(f"N={N}: prefilling {N} x {args.context} tokens")
    while sch.waiting or any(r.num_computed_tokens < len(r.token_ids) - 1 for r in sch.running):
        eng.step()
    for _ in range(args.warmup_steps):
        eng.step()
    if len(sch.running) != N:
        raise SystemExit(f"N={N}: {N - len(sch.running)} requests finished before the timed steps; "
                         "raise --max-model-len")
    timers = {n: Timed(o, n) for o, n in ((sch, "schedule"), (eng.runner, "launch"), (eng.runner, "read"),
                                          (sch, "update_from_output"))}
    walls, ctx = [], []
    for _ in range(args.steps):
        ctx.append(np.mean([len(r.token_ids) for r in sch.running]))
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    for tm in timers.values():
        tm.remove()
    if len(sch.running) != N:
        raise SystemExit(f"N={N}: requests finished during the timed steps; raise --max-model-len")
    captured = capture_next_step(eng.runner)
    eng.step()  # captured, not timed
    eng.runner.wrap_steps(None)
    dev_all = replay(eng.runner, captured, args.replays)
    dev = statistics.median(dev_all)

    med = {n: statistics.median(tm.times) for n, tm in timers.items()}
    med["execute"] = med.pop("launch") + med.pop("read")
    wall = statistics.median(walls)
    mm_all = matmul_times(mc, N, args.dtype, args.replays)
    mm_s = statistics.median(mm_all)
    mm_rate = 2 * N * matmul_params(mc) / mm_s
    context = float(np.mean(ctx))
    flops_token = 2 * matmul_params(mc) + 4 * mc.num_layers * mc.num_heads * mc.head_dim * context
    res = dict(running=N, context_mean=context, step_wall_s=wall, device_s=dev,
               host_overhead_s=wall - dev, host_overhead_pct=100 * (wall - dev) / wall,
               unhidden_host_ms_per_step=1e3 * (wall - dev), async_scheduling=eng.async_scheduling,
               schedule_s=med["schedule"], execute_s=med["execute"], prepare_and_readback_s=med["execute"] - dev,
               update_s=med["update_from_output"],
               engine_rest_s=wall - med["schedule"] - med["execute"] - med["update_from_output"],
               tokens_per_s=N / wall, model_flops_per_token=flops_token, matmul_bench_s=mm_s,
               matmul_bench_flops_per_s=mm_rate, achieved_flops_per_s=N * flops_token / wall,
               decode_efficiency_pct=100 * N * flops_token / wall / mm_rate,
               matmul_time_share_pct=100 * mm_s / wall,
               all_s=dict(step_wall=walls, device=dev_all, matmul_bench=mm_all))  # medians above; noise check
    res["roofline"] = roofline.step_model(eng, N, context)
    bc.say(f"N={N}: step {1e3 * wall:.1f} ms, device {1e3 * dev:.1f} ms, host overhead "
           f"{res['host_overhead_pct']:.1f}%, efficiency {res['decode_efficiency_pct']:.0f}%")
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[8, 64, 128, 256], help="running requests")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per N")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--replays", type=int, default=8, help="device-only replays and matmul repetitions")
    ap.add_argument("--null-device", action="store_true",
                    help="a device step that returns at once with fake tokens: report host time only")
    ap.add_argument("--repeats", type=int, default=5, help="--null-device: timed runs of --steps (medians)")
    ap.add_argument("--stop-strings", nargs="?", const="one", choices=["one", "max", "long"], default=None,
                    help="--null-device: every request has stop strings that never match: one (the default "
                    "when given alone), or at the bound, 16 strings of 64 characters (max) or 15 of one and one "
                    "of 1009 (long)")
    ap.add_argument("--device-ms", type=float, default=0.0, help="--null-device: every step takes this long on a "
                    "simulated in-order device (no CPU used); host_ms_per_step is then the step's wall time and "
                    "unhidden_host_ms_per_step what exceeds the device's")
    ap.add_argument("--final-only", action="store_true", help="--null-device: requests added with stream=False "
                    "(as LLM.generate does: no intermediate outputs); default: streamed, as by the server")
    ap.add_argument("--async-scheduling", choices=["on", "off", "auto"], default="auto",
                    help="the engine's async_scheduling (auto: its default for the platform)")
    # --max-num-seqs is N; --max-model-len and --num-kv-blocks default to what N needs; --async-scheduling above
    bc.add_engine_args(ap, exclude=("async_scheduling",))
    args = ap.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
    if args.null_device:
        if args.steps == 16:
            args.steps = 200
        rows = [measure_null(model_dir, args, N) for N in args.running]
        out = dict(results=rows, model=model_dir, machine=bc.machine_info(), null_device=True,
                   note="null device: the step only transfers its inputs and returns fake tokens; "
                        "medians of --repeats runs")
        print(bc.table([[r["running"], r["host_ms_per_step"], r["null_steps_per_s"], r["host_cpu_ms_per_step"],
                         r["unhidden_host_ms_per_step"], r["schedule_ms"], r["prepare_ms"], r["transfer_ms"],
                         r["update_ms"], r["detokenize_ms"]]
                        for r in rows], ["running", "host ms/step", "null steps/s", "cpu ms/step", "unhidden ms",
                                         "schedule", "prepare", "transfer", "update", "detokenize"]))
        bc.write_json(args.json, out)
        return out
    rows = []
    for N in args.running:
        rows.append(measure(model_dir, args, N))
        gc.collect()  # the previous engine's pool and weights go before the next is built
    peaks = roofline.machine_peaks(args.dtype)
    for r in rows:
        r["roofline"] = roofline.attach(r["roofline"], r["step_wall_s"], peaks)
    out = dict(results=rows, model=model_dir, dtype=args.dtype, machine=bc.machine_info(),
               engine={k: v for k, v in bc.engine_kwargs(args).items() if k != "show_progress"},
               note="decode-only steps; host overhead = step wall time - device-only replay of the same step")
    out["machine_peaks"] = peaks
    print(report(out) + "\n\n" + roofline.report(rows, peaks))
    bc.write_json(args.json, out)
    return out


def report(out: dict) -> str:
    ms = 1e3
    rows = [[r["running"], ms * r["step_wall_s"], ms * r["device_s"], ms * r["schedule_s"],
             ms * r["prepare_and_readback_s"], ms * r["update_s"], ms * r["engine_rest_s"], r["host_overhead_pct"],
             r["tokens_per_s"], r["decode_efficiency_pct"]] for r in out["results"]]
    return f"note: {out['note']}\n" + bc.table(rows, [
        "running", "step ms", "device ms", "schedule ms", "prep+readback ms", "update ms", "engine rest ms",
        "host overhead %", "tok/s", "decode eff. %"])


if __name__ == "__main__":
    main()
