"""`latency.py --backend llama-cpp`: llama.cpp (llama-cpp-python) on a GGUF file, in a subprocess.

llama-cpp-python runs under its own interpreter (--llama-python, default: this one), so it can live in a
separate virtual environment built for this CPU; the run is skipped, with a message saying why, when
`import llama_cpp` fails there. Installing it built from source with the native CPU flags:
    python -m venv ~/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" ~/llama-venv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    jaxpaged bench latency --backend llama-cpp --llama-python ~/llama-venv/bin/python

One sequence (llama-cpp-python serves one stream): the prompt's token ids as given (the engine's tokens,
so both read the same prompt), greedy, `output_len` tokens, `repeats` times; decode ms per token =
(last token - first token) / (tokens - 1), time to first token from the call.

This file is also the worker: `python llama_cpp_peer.py JOB.json OUT.json` under llama-cpp-python's
interpreter (it imports only the standard library and llama_cpp).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def add_args(ap) -> None:
    g = ap.add_argument_group("llama-cpp backend")
    g.add_argument("--llama-python", default=sys.executable,
                   help="interpreter that can `import llama_cpp` (e.g. a separate venv's bin/python)")
    g.add_argument("--llama-threads", type=int, default=os.cpu_count(),
                   help="llama.cpp's n_threads (default: every core)")


def unavailable(args) -> str | None:
    """None when `import llama_cpp` works under --llama-python; otherwise why the backend is skipped."""
    from jaxpaged.bench import common as bc
    failed = bc.import_failure(args.llama_python, "llama_cpp")
    if failed is None:
        return None
    ran, why = failed
    if not ran:
        return f"llama-cpp skipped: cannot run {args.llama_python} ({why})"
    return (f"llama-cpp-python not importable by {args.llama_python} ({why}); install it there or pass "
            f"--llama-python")


def run_llama_cpp(args, path: str, prompt: list[int], output_len: int, repeats: int) -> dict:
    """The worker's result on GGUF file `path`: ms_per_token_runs, ttft_ms, version, system_info."""
    job = dict(path=path, prompt=prompt, output_len=output_len, repeats=repeats, n_threads=args.llama_threads,
               n_ctx=max(256, len(prompt) + output_len + 8))
    with tempfile.TemporaryDirectory(prefix="jaxpaged-llama-cpp-") as d:
        job_file, out_file = os.path.join(d, "job.json"), os.path.join(d, "out.json")
        with open(job_file, "w") as f:
            json.dump(job, f)
        p = subprocess.run([args.llama_python, os.path.abspath(__file__), job_file, out_file], capture_output=True,
                           text=True)
        if p.returncode or not os.path.isfile(out_file):
            raise RuntimeError(f"llama-cpp worker failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        with open(out_file) as f:
            return json.load(f)


def _worker(job_file: str, out_file: str) -> None:
    import llama_cpp
    with open(job_file) as f:
        job = json.load(f)
    llm = llama_cpp.Llama(model_path=job["path"], n_ctx=job["n_ctx"], n_threads=job["n_threads"], verbose=False)
    per_token, ttft = [], []
    for _ in range(job["repeats"]):
        llm.reset()
        t0 = time.perf_counter()
        first, n = None, 0
        for _tok in llm.generate(job["prompt"], temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == job["output_len"]:
                break
        per_token.append(1e3 * (time.perf_counter() - first) / (n - 1))
        ttft.append(1e3 * (first - t0))
    out = dict(ms_per_token_runs=per_token, ttft_ms_runs=ttft, n_threads=job["n_threads"],
               version=llama_cpp.__version__, system_info=llama_cpp.llama_print_system_info().decode())
    with open(out_file, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
