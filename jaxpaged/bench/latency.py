"""Latency of a few requests: ms per output token at 1, 2, 4 and 8 concurrent requests, against the
time it takes this machine to read the weights once, with the peers side by side in one run.

    jaxpaged bench latency --json docs/results/latency.json
    jaxpaged bench latency --model random:llama-1b-smol --backend jaxpaged-int4 --concurrency 1
    jaxpaged bench latency --model random:llama-1b-smol-q4_k --backend jaxpaged-bfloat16 --backend llama-cpp \
        --concurrency 1 --llama-python ~/llama-venv/bin/python

Backends (`--backend`, default all but int8-channel): jaxpaged in float32, bfloat16, and bfloat16 activations
with int8 or int4 layer weights (their defaults: groups of 32 with a minimum; `jaxpaged-int8-channel`: int8
with one scale a column) (each its own engine in this process,
`max_num_seqs` 64 as `LLM()`; a KV pool just large enough for the largest N at `--max-model-len`, so the
engines fit beside each other), vLLM's CPU build (`--vllm-python`, jaxpaged/bench/vllm_peer.py) and
llama.cpp (`--llama-python`, jaxpaged/bench/llama_cpp_peer.py) on `--gguf` (default: the model's own file
where `--model` is a GGUF, else the GGUF the default model is made from) when they are installed; a
missing peer is reported with the reason. `--model` takes any model directory, GGUF file or random preset
(`random:llama-1b-smol`: the 1B-class model with a real tokenizer; `random:llama-1b-smol-q4_k` (-q8_0,
-q4_0, -q4_1): that model written once as a GGUF of that type, jaxpaged/bench/common.py). On a GGUF
jaxpaged keeps the file's matrices packed (`--keep-quantized`, the default), so jaxpaged and llama.cpp
read the same file; the JSON names each GGUF's tensor types, and the command and commit that made it.
`--matmul-compare xla cpu` builds each jaxpaged engine once per weight-product backend (`matmul_backend`),
timed in the same rounds: an A/B of the products; each row records `stats()["matmul_backend"]`.

Workload: N requests of a short prompt (`--prompt-len` tokens of text, each its own) and `--output-len` greedy
tokens each, EOS ignored, submitted at once. Per request, decode ms per token = (finish - first token) /
(output tokens - 1); a row gives the median over the requests and the repeats, with the time to first token (a
whole prefill: every engine runs without its prefix cache, since the warm-up and the repeats reuse the
prompts, and llama.cpp's worker resets its context each repeat), and `cpu_ms_per_step`: the process's CPU time
(all threads) per engine step, the median over the repeats; the machine's other load moves it far less than
the wall time (a step that waits for a core costs wall time, not CPU time), so it tells an engine's own extra
work (e.g. beside the other engines of this process) from a busier machine. The jaxpaged engines run
interleaved (repeat r: every engine at every N, then r + 1), so a change of the machine's load falls on all of
them alike; the load average is recorded beside each row.
llama.cpp runs in the same rounds: loaded once in its worker process and warmed up as the engines are, it takes
its repeat r at the start of round r.
vLLM (a subprocess per N) is timed by elapsed time only: (t(output-len) - t(1)) / (output-len - 1).

Weight-read time per row: the bytes of parameters a decode step reads (every matrix as stored, once; an
untied embedding only for its N rows) divided by this machine's read bandwidth, measured in the same run
(`roofline.machine_peaks`: a jitted sum over 256 MiB on all cores, bytes read per second: what a step
that only streamed its weights would reach); `memcpy GB/s` beside it is the bytes one `np.copyto` moves
per second (one core, each byte counted once: the issue's convention), with its ratio too. The in-place
`x * 2` rate (bytes read plus written) is recorded in `peaks` but not used: a decode step writes little.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.bench import roofline, timing

CONCURRENCY = (1, 2, 4, 8)
JAXPAGED = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
            "int8": dict(dtype="bfloat16", quantization="int8"), "int4": dict(dtype="bfloat16", quantization="int4"),
            "int8-channel": dict(dtype="bfloat16", quantization="int8", quantization_group_size=0)}
DEFAULT_JAXPAGED = ("float32", "bfloat16", "int8", "int4")  # the backends run when none is named


def memcpy_bytes_per_s(mib: int = 256, reps: int = 5) -> float:
    """Bytes one np.copyto moves per second (best of reps), each byte counted once."""
    src = np.ones(mib * 2 ** 20 // 4, np.float32)
    dst = np.empty_like(src)
    return src.nbytes / min(timing.samples(np.copyto, dst, src, reps=reps, warmup=0))


def weight_bytes(engine, n: int) -> float:
    """Parameter bytes one decode step of n requests reads (roofline.step_model's weights)."""
    return roofline.step_model(engine, n, 0)["weight_bytes"]


# every jaxpaged engine of this bench: the warm-up and the repeats reuse the prompts, so with the prefix cache a
# request's first token would come from a cache hit (llama.cpp's worker resets its context each repeat)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}


def process_cpu_s() -> float:
    """CPU seconds this process has run (all its threads, user and system; nanosecond resolution, where
    `os.times` counts 10 ms ticks: a tiny model's whole call can be under one)."""
    return time.process_time()


def run_once(llm, prompts: list[list[int]], output_len: int) -> dict:
    """The prompts at once; per-request decode ms per token and time to first token, and the process's CPU ms
    per engine step of the call (all threads: a figure the machine's other load moves far less than the wall
    time, since it counts the engine's work and not its waits for a core)."""
    from jaxpaged import SamplingParams
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    cpu0 = process_cpu_s()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    cpu_ms_per_step = 1e3 * (process_cpu_s() - cpu0) / output_len  # output_len steps: the prefill, then decodes
    per_token, ttft = [], []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        per_token.append(1e3 * (m["finished_time"] - m["first_token_time"]) / (n - 1))
        ttft.append(1e3 * (m["first_token_time"] - m["arrival_time"]))
    return dict(ms_per_token=per_token, ttft_ms=ttft, cpu_ms_per_step=cpu_ms_per_step)


def measure_jaxpaged(model_dir: str, args, names: dict[str, dict], prompts: list[list[int]],
                     each_repeat=None) -> dict:
    """names: row name -> the engine's keyword arguments over the flags'. each_repeat(r): called at the start of
    repeat r, after the engines are built (the llama.cpp peer's repeat, in the same rounds)."""
    llms = {}
    for name, over in names.items():
        llm = bc.build_llm(model_dir, args, **{**NO_PREFIX_CACHE, **over})
        run_once(llm, prompts[:1], 8)  # warm-up
        llms[name] = llm
    runs = {(name, n): [] for name in names for n in args.concurrency}
    for r in range(args.repeats):
        if each_repeat:
            each_repeat(r)
        for name in names:
            for n in args.concurrency:
                got = run_once(llms[name], prompts[:n], args.output_len)
                got["load"] = os.getloadavg()[0]
                runs[name, n].append(got)
                bc.say(f"repeat {r + 1}/{args.repeats} {name} N={n}: "
                       f"{statistics.median(got['ms_per_token']):.1f} ms/token, {got['cpu_ms_per_step']:.1f} CPU ms "
                       f"a step (load {got['load']:.1f})")
    out = {}
    for name in names:
        eng = llms[name].engine
        for n in args.concurrency:
            rs = runs[name, n]
            per_token = [statistics.median(g["ms_per_token"]) for g in rs]
            out[f"jaxpaged {name}", n] = dict(
                ms_per_token=statistics.median(per_token), ms_per_token_runs=per_token,
                ttft_ms=statistics.median([statistics.median(g["ttft_ms"]) for g in rs]),
                cpu_ms_per_step=statistics.median(g["cpu_ms_per_step"] for g in rs),
                load=[g["load"] for g in rs], weight_bytes=weight_bytes(eng, n),
                compile_s=llms[name].stats().get("compile_seconds"), num_buckets=len(eng.runner.buckets),
                matmul_backend=llms[name].stats().get("matmul_backend"),
                prefix_caching=eng.config.enable_prefix_caching)
    return out


def measure_vllm(model_dir: str, args, prompts: list[list[int]]) -> tuple[dict, str | None]:
    from jaxpaged.bench import vllm_peer
    why = vllm_peer.unavailable(args)
    if why:
        return {}, why
    out = {}
    export_root = os.path.join(os.path.dirname(model_dir), "vllm-export")
    for dtype in vllm_peer.dtypes(args):
        for n in args.concurrency:
            t = {}
            for length in (1, args.output_len):
                wl = bc.Workload([bc.Req(p, length) for p in prompts[:n]])
                t[length] = vllm_peer.run_vllm(model_dir, wl, args, export_root, dtype,
                                               prefix_caching=False)["elapsed_s"]
            per_token = 1e3 * (t[args.output_len] - t[1]) / (args.output_len - 1)
            out["vllm " + dtype, n] = dict(ms_per_token=per_token, ttft_ms=1e3 * t[1], load=[os.getloadavg()[0]],
                                            weight_bytes=None, note="elapsed time only")
    return out, None


class LlamaCpp:
    """llama.cpp on GGUF file `path`, one sequence (jaxpaged/bench/llama_cpp_peer.py), loaded once and timed a
    repeat at a time (`repeat`), between the jaxpaged engines' repeats; `why` says why it is not there (not
    installed, no file, or its worker failed: its rows are dropped, the others still count)."""

    def __init__(self, args, path: str | None, prompts: list[list[int]]):
        from jaxpaged.bench import llama_cpp_peer
        self.path, self.runs, self.peer = path, [], None
        self.why = "no GGUF file (pass --gguf)" if path is None else llama_cpp_peer.unavailable(args)
        if self.why is None:
            try:
                self.peer = llama_cpp_peer.Peer(args, path, prompts[0], args.output_len)
            except RuntimeError as e:  # the worker failed on this file
                self.why = str(e)

    def repeat(self, r: int) -> None:
        if self.peer is None:
            return
        try:
            got = self.peer.run(1)
        except RuntimeError as e:
            self.why, self.runs = str(e), []
            self.close()
            return
        self.runs.append(got)
        bc.say(f"repeat {r + 1} llama.cpp N=1: {got['ms_per_token_runs'][0]:.1f} ms/token (load "
               f"{os.getloadavg()[0]:.1f})")

    def rows(self) -> dict:
        if self.peer is None or not self.runs:
            return {}
        info, per_token = gguf_info(self.path), [g["ms_per_token_runs"][0] for g in self.runs]
        row = dict(ms_per_token=statistics.median(per_token), ms_per_token_runs=per_token,
                   ttft_ms=statistics.median(g["ttft_ms_runs"][0] for g in self.runs), load=[os.getloadavg()[0]],
                   weight_bytes=float(info["tensor_bytes"]), note="one sequence", gguf_types=info["types"],
                   llama_cpp=dict(version=self.peer.info["version"], n_threads=self.peer.info["n_threads"],
                                  system_info=self.peer.info["system_info"]))
        return {(f"llama.cpp ({os.path.basename(self.path)})", 1): row}

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None


def gguf_info(path: str) -> dict:
    """A GGUF file's path, size, tensor bytes and tensor count per type (e.g. {"Q4_K": 112, "F32": 33})."""
    import collections

    import gguf
    tensors = gguf.GGUFReader(path).tensors
    return dict(path=os.path.abspath(path), file_bytes=os.path.getsize(path),
                tensor_bytes=int(sum(int(t.n_bytes) for t in tensors)),
                types=dict(collections.Counter(t.tensor_type.name for t in tensors)))


def _default_gguf(model_dir: str) -> str | None:
    """llama.cpp's file: the model's own where it is a GGUF, else the default model's GGUF."""
    from jaxpaged.checkpoints.default_model import default_gguf_path
    from jaxpaged.checkpoints.gguf_load import gguf_source
    own = gguf_source(model_dir)
    if own:
        return own
    try:
        return default_gguf_path(verbose=False)
    except (OSError, RuntimeError):
        return None


def measure_startup(model_dir: str, args) -> dict:
    """Cold and warm start to the first token of a lone short prompt (startup.py's child process:
    interpreter, imports, weights, every bucket compiled or loaded from the cache, one token), per dtype."""
    import tempfile

    from jaxpaged.bench import startup
    out = {}
    for dtype in args.startup:
        cache = tempfile.mkdtemp(prefix="jaxpaged-latency-startup-")
        a = argparse.Namespace(**{**vars(args), "dtype": dtype})
        cold = startup.spawn(a, model_dir, cache)
        warm = startup.spawn(a, model_dir, cache)
        out[dtype] = dict(cold=cold, warm=warm, load=os.getloadavg()[0])
        bc.say(f"start-up {dtype}: cold {cold['time_to_first_token_s']:.1f} s (compile {cold['compile_s']:.1f} s), "
               f"warm {warm['time_to_first_token_s']:.1f} s")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", choices=[f"jaxpaged-{n}" for n in JAXPAGED] + ["vllm", "llama-cpp"],
                    help="default: all")
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--startup", nargs="*", default=[], choices=["float32", "bfloat16"],
                    help="also time cold and warm start to the first token in fresh processes, per dtype")
    ap.add_argument("--matmul-compare", nargs="+", default=None, choices=["auto", "xla", "cpu"],
                    help="each jaxpaged engine once per matmul_backend, interleaved (A/B in one run)")
    ap.add_argument("--gguf", default=None, help="llama.cpp's model (default: --model where it is a GGUF file or "
                    "preset, else the default model's GGUF)")
    from jaxpaged.bench import llama_cpp_peer, vllm_peer
    vllm_peer.add_args(ap)
    llama_cpp_peer.add_args(ap)
    bc.add_engine_args(ap, max_model_len=1024)
    ap.set_defaults(random_tokens=False)
    args = ap.parse_args(argv)
    if args.num_kv_blocks is None:  # room for the largest N at max_model_len, not the engine's 2 GB default
        args.num_kv_blocks = max(args.concurrency) * -(-args.max_model_len // args.block_size) + 1
    backends = args.backend or [f"jaxpaged-{n}" for n in DEFAULT_JAXPAGED] + ["vllm", "llama-cpp"]
    model_dir = bc.resolve_model(args.model)
    vocab, tok = bc.model_vocab_and_tokenizer(model_dir)
    rng = np.random.default_rng(args.seed)
    prompts = [bc.prompt_ids(rng, args.prompt_len, tok, vocab) for _ in range(max(args.concurrency))]

    rows, missing = {}, {}
    if "vllm" in backends:  # first: its engine starts in a subprocess, before ours take the memory
        got, why = measure_vllm(model_dir, args, prompts)
        rows.update(got)
        if why:
            missing["vllm"] = why
    gguf = args.gguf or _default_gguf(model_dir)
    llama = LlamaCpp(args, gguf, prompts) if "llama-cpp" in backends else None
    names = {b.split("-", 1)[1]: JAXPAGED[b.split("-", 1)[1]] for b in backends if b.startswith("jaxpaged-")}
    if args.matmul_compare:  # each engine once per products' backend, in the same rounds
        names = {f"{n} matmul={m}": {**kw, "matmul_backend": m} for n, kw in names.items() for m in args.matmul_compare}
    try:
        if names:  # llama.cpp's repeats interleaved with the engines'
            rows.update(measure_jaxpaged(model_dir, args, names, prompts, llama.repeat if llama else None))
        elif llama:
            for r in range(args.repeats):
                llama.repeat(r)
        if llama:
            rows.update(llama.rows())
            if llama.why:
                missing["llama-cpp"] = llama.why
    finally:
        if llama:
            llama.close()
    startup = measure_startup(model_dir, args) if args.startup else {}
    peaks = roofline.machine_peaks("float32")
    peaks["memcpy_bytes_per_s"] = memcpy_bytes_per_s()
    for r in rows.values():
        if r.get("weight_bytes"):
            r["weight_read_ms"] = 1e3 * r["weight_bytes"] / peaks["read_bytes_per_s"]
            r["weight_read_ms_memcpy"] = 1e3 * r["weight_bytes"] / peaks["memcpy_bytes_per_s"]
            r["x_weight_read"] = r["ms_per_token"] / r["weight_read_ms"]
            r["x_weight_read_memcpy"] = r["ms_per_token"] / r["weight_read_ms_memcpy"]
    from jaxpaged.checkpoints.gguf_load import gguf_source
    files = {"model": gguf_source(model_dir), "llama.cpp": gguf if "llama-cpp" in backends else None}
    out = dict(rows=[dict(backend=b, running=n, **r) for (b, n), r in rows.items()], missing=missing,
               gguf={k: gguf_info(v) for k, v in files.items() if v}, **bc.run_info("latency", argv),
               startup=startup, peaks=peaks, load_at_end=os.getloadavg(),
               workload=dict(prompt_len=args.prompt_len, output_len=args.output_len, repeats=args.repeats,
                             concurrency=args.concurrency, greedy=True, ignore_eos=True),
               engine={k: v for k, v in bc.engine_kwargs(args, **NO_PREFIX_CACHE).items() if k != "show_progress"},
               machine=bc.machine_info())
    print(report(out))
    bc.write_json(args.json, out)
    return out


def report(out: dict) -> str:
    p = out["peaks"]
    head = (f"read bandwidth {p['read_bytes_per_s'] / 1e9:.1f} GB/s (in-place x*2, read + write: "
            f"{p['copy_bytes_per_s'] / 1e9:.1f}), memcpy {p['memcpy_bytes_per_s'] / 1e9:.1f} GB/s")
    body = [[r["backend"], r["running"], r["ms_per_token"], 1e3 / r["ms_per_token"] * r["running"], r["ttft_ms"],
             (r.get("weight_bytes") or 0) / 1e6, r.get("weight_read_ms", "-"), r.get("x_weight_read", "-"),
             r.get("x_weight_read_memcpy", "-"), max(r["load"])] for r in out["rows"]]
    lines = [head, bc.table(body, ["backend", "running", "ms/token", "tok/s", "TTFT ms", "weights MB",
                                   "weight read ms", "x weight read", "x memcpy read", "load max"])]
    lines += [f"start-up {d}: cold {s['cold']['time_to_first_token_s']:.1f} s "
              f"(compile {s['cold']['compile_s']:.1f} s), warm {s['warm']['time_to_first_token_s']:.1f} s"
              for d, s in out["startup"].items()]
    lines += [f"missing: {k}: {v}" for k, v in out["missing"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
