"""The bfloat16 weight products of a model size on the CPU: the C++ kernel (pallas_kernels/matmul/cpu.py) on
each of its paths against XLA's dot, and against the time this machine takes to read the same bytes.

    jaxpaged bench cpu_matmul --preset llama-1b-smol smollm2-135m --json docs/results/matmul_bf16_cpu.json

Per preset (jaxpaged/bench/common.py PRESETS) and row count M (`--rows`), the products a decode step runs:
q / o [D, D], k / v [D, KV], gate / up [D, I], down [I, D], each a stack of the model's L layers read one
layer after another in one jitted loop (as the step's layer loop reads them: every matrix from memory, not
from the caches), and the tied lm_head, once. XLA multiplies the plain stack as the engine does without the
kernel (`quant.dot` of a layer of the stack, float32 accumulation; the embedding [V, D] read transposed);
the kernel reads the stack packed once (`pack`, as the runner keeps it) at its layer index, and the
embedding packed as the head [D, V] (as jaxpaged/models/packed.py keeps a tied head), on every path of `--isa`
(default: the build's best down to AVX2; a path above the build's best runs the best, so it is left out).
Times are per matrix (the loop's time / L), medians of `--repeats` samples taken in rounds (every
backend once per round), the load average recorded per row. `read ms` is the matrix's bytes over the
machine's read rate (`roofline.machine_peaks`: a jitted float32 sum over 256 MiB on all cores).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from jaxpaged.bench import common as bc
from jaxpaged.bench import roofline, timing


def shapes(preset: str) -> list[tuple[str, int, int, int, bool]]:
    """(name, layers, K, N, transpose) of the preset's bfloat16 products; transpose: the tied embedding [N, K]."""
    c = bc.PRESETS[preset]
    D, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    L, KV, I, V = c["num_hidden_layers"], c["num_key_value_heads"] * hd, c["intermediate_size"], c["vocab_size"]
    return [("q/o", L, D, D, False), ("k/v", L, D, KV, False), ("gate/up", L, D, I, False),
            ("down", L, I, D, False), ("lm_head (tied)", 1, D, V, True)]


def products(L: int, transpose: bool, isas: list[str]):
    """name -> jitted f(x, w) summing every layer's product (w: the stack, or its packed tiles for the
    kernel; the lm_head one matrix: the embedding [N, K] for XLA, its transpose's tiles for the kernel)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.quant import LayerOf, dot
    from pallas_kernels.matmul import cpu as cpu_matmul

    def loop(one):
        def f(x, w):
            if transpose:
                return one(x, w, None)
            return jax.lax.fori_loop(0, L, lambda l, acc: acc + one(x, w, l), jnp.zeros((x.shape[0], n(w)),
                                                                                       jnp.float32))
        return jax.jit(f)

    def n(w):
        return w.shape[-4] * 16 if w.ndim == 5 else w.shape[-1]

    fns = {"xla": loop(lambda x, w, l: dot(x, w if l is None else LayerOf(w, l), jnp.float32, transpose=transpose))}
    for isa in isas:
        fns[isa] = loop(lambda x, w, l, isa=isa: cpu_matmul.cpu_matmul(x, w, layer=l, packed=True, isa=isa))
    return fns


def measure(preset: str, rows: list[int], isas: list[str], repeats: int, read_bytes_per_s: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.matmul import cpu as cpu_matmul
    out = []
    for name, L, K, N, transpose in shapes(preset):
        key = jax.random.key(len(out))
        w = jax.random.normal(key, (N, K) if transpose else (L, K, N), jnp.bfloat16)
        packed = jax.jit(lambda w: cpu_matmul.pack(w.T if transpose else w))(w)
        fns = products(L, transpose, isas)
        for M in rows:
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.bfloat16)
            args = {b: (x, w if b == "xla" else packed) for b in fns}
            results = {b: np.asarray(f(*args[b])) for b, f in fns.items()}  # compiled, warm
            scale = float(np.abs(results["xla"]).max())
            diff = max(float(np.abs(r - results["xla"]).max()) for r in results.values()) / scale
            times = {b: [] for b in fns}
            for _ in range(repeats):
                for b, f in fns.items():
                    times[b] += timing.samples(f, *args[b], reps=1, warmup=0)
            ms = {b: 1e3 * statistics.median(t) / L for b, t in times.items()}
            read_ms = 1e3 * K * N * 2 / read_bytes_per_s
            row = dict(preset=preset, matrix=name, M=M, K=K, N=N, layers=L, transpose=transpose,
                       xla_ms=ms["xla"], kernel_ms={i: ms[i] for i in isas}, read_ms=read_ms,
                       speedup={i: ms["xla"] / ms[i] for i in isas}, x_read={b: v / read_ms for b, v in ms.items()},
                       max_rel_diff=diff, load=os.getloadavg()[0])
            bc.say(f"{preset} {name} M={M}: xla {ms['xla']:.3f} ms, " +
                   ", ".join(f"{i} {ms[i]:.3f} ms" for i in isas) + f", read {read_ms:.3f} ms")
            out.append(row)
        del w, packed
    return out


def main(argv=None) -> dict:
    from pallas_kernels.matmul import cpu as cpu_matmul
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["llama-1b-smol"], choices=sorted(bc.PRESETS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--isa", nargs="+", default=None, choices=list(cpu_matmul.ISAS),
                    help="the kernel's paths to time (default: the build's best down to avx2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    best = cpu_matmul.isa()
    if best is None:
        raise SystemExit("the CPU matmul kernel cannot be built here (see the warning above)")
    order = list(cpu_matmul.ISAS)
    isas = args.isa or [i for i in reversed(order) if order.index("avx2") <= order.index(i) <= order.index(best)]
    isas = [i for i in isas if order.index(i) <= order.index(best)]
    load_start = os.getloadavg()
    peaks = roofline.machine_peaks("float32")
    rows = [r for p in args.preset for r in measure(p, args.rows, isas, args.repeats, peaks["read_bytes_per_s"])]
    print(bc.table([[r["preset"], r["matrix"], r["M"], r["xla_ms"], *(r["kernel_ms"][i] for i in isas), r["read_ms"],
                     *(f"{r['speedup'][i]:.2f}x" for i in isas), r["load"]] for r in rows],
                   ["preset", "matrix", "M", "xla ms", *(f"{i} ms" for i in isas), "read ms",
                    *(f"{i} vs xla" for i in isas), "load"]))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    out = dict(command="jaxpaged bench cpu_matmul " + " ".join(sys.argv[1:] if argv is None else argv),
               commit=commit, best_isa=best, isas=isas, rows=rows, peaks=peaks, load_start=load_start,
               load_end=os.getloadavg(), march=os.environ.get("JAXPAGED_CPU_KERNEL_MARCH", "native"),
               machine=bc.machine_info())
    bc.write_json(args.json, out)
    return out
