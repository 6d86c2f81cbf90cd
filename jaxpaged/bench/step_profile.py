"""A compiled step's time by kind of kernel, read from a `jax.profiler` trace of the step replayed.

XLA:CPU runs a compiled program as thunks (one per fusion, custom call, copy, ...) on its thread pool; the
profiler records each thunk's span with its HLO instruction's name (the `hlo_op` stat). `kinds` maps every
instruction of the compiled program to a kind by its HLO text:
- `products`: a custom call whose target is a matmul kernel (the AMX and the quantized C++ products), an
  XLA `dot` / `convolution`, or a fusion that contains one;
- `attention`: a custom call whose target is an attention kernel;
- `xla_own`: every other thunk (norms, RoPE, the KV writes, gathers, the sampler, copies);
- while / conditional / call thunks hold others: they are not counted themselves.
`profile_step` calls the step in pairs, one untraced (timed) and one traced in a session of its own inside
an annotation (the call's window), each right after an untimed call, and shares each instant of the traced
window of median length among the thunks running then (two at once: half each), so the kinds and `between`
(no thunk running: dispatch, waits, thread-pool wake-ups) add up to that window. The tracer's own cost,
`profiler_ms`, is that window less the untraced call of the same rank: it lies inside the kinds and
`between` in shares the trace cannot tell (not only in `between`: the thunks' summed spans can exceed the
untraced call).
"""
from __future__ import annotations

import glob
import re
import resource
import tempfile
import time
from collections import defaultdict

KINDS = ("products", "attention", "xla_own")
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")
WINDOW = "jaxpaged_step_replay"  # the annotation around each replay

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?\s([a-z][a-z0-9\-_]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")


def parse_hlo(text: str) -> tuple[dict, dict]:
    """Compiled HLO text -> ({instruction: (opcode, custom-call target or '', called computations)},
    {computation: its instructions' names})."""
    instrs, comps, current = {}, defaultdict(list), None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head and " = " not in line:
            current = head.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        target = _TARGET.search(line)
        called = [c.strip(" {}%") for group in _CALLS.findall(line) for c in group.split(",")]
        instrs[name] = (opcode, target.group(1) if target else "", called)
        comps[current].append(name)
    return instrs, comps


def kinds(text: str) -> dict[str, str]:
    """Each instruction of a compiled program (HLO text) -> 'products' | 'attention' | 'xla_own' |
    'container' (see the module docstring)."""
    instrs, comps = parse_hlo(text)
    memo: dict[str, bool] = {}

    def has_dot(comp: str) -> bool:  # the computation (or one it calls) multiplies matrices
        if comp not in memo:
            memo[comp] = False
            memo[comp] = any(instrs[i][0] in ("dot", "convolution") or any(has_dot(c) for c in instrs[i][2])
                             for i in comps.get(comp, ()))
        return memo[comp]

    out = {}
    for name, (opcode, target, called) in instrs.items():
        if opcode in CONTAINERS:
            out[name] = "container"
        elif "attention" in target:
            out[name] = "attention"
        elif "matmul" in target or opcode in ("dot", "convolution") or (
                opcode == "fusion" and any(has_dot(c) for c in called)):
            out[name] = "products"
        else:
            out[name] = "xla_own"
    return out


def share(spans: list[tuple[int, int, str]], start: int, end: int) -> dict[str, float]:
    """ns of [start, end] per kind: each instant split evenly among the spans (t0, t1, kind) running then;
    'between' for the instants none runs."""
    points = []
    for t0, t1, kind in spans:
        t0, t1 = max(t0, start), min(t1, end)
        if t1 > t0:
            points += [(t0, 1, kind), (t1, -1, kind)]
    points.sort(key=lambda p: (p[0], p[1]))
    out = defaultdict(float)
    active: dict[str, int] = defaultdict(int)
    last = start
    for t, delta, kind in points:
        n = sum(active.values())
        if t > last:
            if n:
                for k, c in active.items():
                    out[k] += (t - last) * c / n
            else:
                out["between"] += t - last
        last = max(last, t)
        active[kind] += delta
    out["between"] += max(end - last, 0)
    return dict(out)


def minor_faults() -> int:
    """This process's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def trace_once(step, module: str, kind_of: dict) -> dict:
    """One `jax.profiler` session: an untimed call (the tracer's first-call costs), then one call inside the
    WINDOW annotation; its window (ns), the spans (t0, t1, kind) of its thunks and ns per xla_own instruction."""
    import jax
    from jax.profiler import ProfileData
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python functions untraced: they would slow the dispatch in the window
    options.enable_hlo_proto = False
    with tempfile.TemporaryDirectory(prefix="jaxpaged-step-profile-") as d:
        jax.profiler.start_trace(d, profiler_options=options)
        try:
            step()
            with jax.profiler.TraceAnnotation(WINDOW):
                step()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace under {d}")
        trace = ProfileData.from_file(files[0])
    windows, events = [], []
    for plane in trace.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name == WINDOW:
                    windows.append((e.start_ns, e.start_ns + e.duration_ns))
                    continue
                stats = dict(e.stats)
                op = stats.get("hlo_op")
                if op is None or stats.get("hlo_module") != module or kind_of.get(op, "container") == "container":
                    continue
                events.append((e.start_ns, e.start_ns + e.duration_ns, op))
    if len(windows) != 1:
        raise RuntimeError(f"the trace holds {len(windows)} step windows, not 1")
    (t0, t1), spans, per_op = windows[0], [], defaultdict(float)
    for a, b, op in events:
        if a >= t1 or b <= t0:  # the untimed first call's
            continue
        spans.append((a, b, kind_of[op]))
        if kind_of[op] == "xla_own":
            per_op[op] += min(b, t1) - max(a, t0)
    return dict(window=(t0, t1), spans=spans, per_op=per_op)


def profile_step(step, hlo_text: str, module: str, reps: int) -> dict:
    """`reps` pairs of calls of step() (each waits for its result), one untraced and timed, one traced in its
    own session (trace_once), the pair's order alternating, each after an untimed call. Returns the ms per
    kind (KINDS and 'between') of the traced call of median window ('window_ms', which they add up to), the
    untraced call of the same rank ('replay_ms'), the tracer's own cost ('profiler_ms' = window_ms -
    replay_ms), each pair's [untraced, traced] ms ('pairs_ms'), minor page faults per untraced call, thunks
    per call and the ten instructions with the most time in that window outside the products and attention
    ('top_xla_own')."""
    kind_of = kinds(hlo_text)
    step()  # not timed: compiled and warm
    untraced, traced, faults = [], [], 0

    def plain():  # an untimed call first, as in trace_once: each timed call follows a call of the step
        nonlocal faults
        step()
        f, t = minor_faults(), time.perf_counter()
        step()
        untraced.append(time.perf_counter() - t)
        faults += minor_faults() - f

    def trace():
        traced.append(trace_once(step, module, kind_of))
    for i in range(reps):  # untraced, traced, traced, untraced, ...: a drift of the machine's speed cancels
        for call in ((plain, trace) if i % 2 == 0 else (trace, plain)):
            call()
    rank = (reps - 1) // 2  # the same rank of both: median(traced) - median(untraced) is the tracer's cost
    chosen = sorted(traced, key=lambda r: r["window"][1] - r["window"][0])[rank]
    (t0, t1), spans = chosen["window"], chosen["spans"]
    parts = share(spans, t0, t1)  # the call of median window, whole: its parts add up to it
    out = {f"{k}_ms": parts.get(k, 0.0) / 1e6 for k in (*KINDS, "between")}
    window_ms, replay_ms = (t1 - t0) / 1e6, 1e3 * sorted(untraced)[rank]
    top = sorted(chosen["per_op"].items(), key=lambda kv: -kv[1])[:10]
    pairs = [[1e3 * u, (r["window"][1] - r["window"][0]) / 1e6] for u, r in zip(untraced, traced)]
    out.update(window_ms=window_ms, replay_ms=replay_ms, profiler_ms=window_ms - replay_ms, pairs_ms=pairs,
               replay_faults=faults / reps, thunks_per_step=len(spans),
               top_xla_own=[dict(op=op, ms=ns / 1e6) for op, ns in top])
    return out
