"""`latency.py --backend llama-cpp`: llama.cpp (llama-cpp-python) on a GGUF file, in a subprocess.

llama-cpp-python runs under its own interpreter (--llama-python, default: this one), so it can live in a
separate virtual environment built for this CPU; the run is skipped, with a message saying why, when
`import llama_cpp` fails there. Installing it built from source with the native CPU flags:
    python -m venv ~/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" ~/llama-venv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    jaxpaged bench latency --backend llama-cpp --llama-python ~/llama-venv/bin/python

One sequence (llama-cpp-python serves one stream): the prompt's token ids as given (the engine's tokens,
so both read the same prompt), greedy, `output_len` tokens, each time asked; decode ms per token =
(last token - first token) / (tokens - 1), time to first token from the call.

This file is also the worker (`Peer` starts it: `python llama_cpp_peer.py` under llama-cpp-python's interpreter,
a JSON line in and out per request; it imports only the standard library and llama_cpp): the model loaded once and
warmed up with one short generation, then timed whenever latency.py asks, between its own engines' repeats.
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


class Peer:
    """llama.cpp loaded once, in its worker process under --llama-python, for `run` to time generations whenever
    the caller asks: latency.py interleaves them with its own engines' repeats, so a change of the machine's
    memory bandwidth or load between repeats falls on both alike; `close` ends the worker. RuntimeError (with the
    worker's stderr) when it fails to start or to answer."""

    def __init__(self, args, path: str, prompt: list[int], output_len: int):
        job = dict(path=path, prompt=prompt, output_len=output_len, n_threads=args.llama_threads,
                   n_ctx=max(256, len(prompt) + output_len + 8))
        self._err = tempfile.TemporaryFile(mode="w+")
        self._p = subprocess.Popen([args.llama_python, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=self._err, text=True)
        try:
            self.info = self._ask(job)  # loaded and warmed up: version, system_info, n_threads
        except RuntimeError:
            self.close()  # the stderr file too
            raise

    def _ask(self, message: dict) -> dict:
        try:
            self._p.stdin.write(json.dumps(message) + "\n")
            self._p.stdin.flush()
            line = self._p.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self._p.wait()
            self._err.seek(0)
            raise RuntimeError(f"llama-cpp worker failed (exit {self._p.returncode}):\n{self._err.read()[-3000:]}")
        return json.loads(line)

    def run(self, repeats: int = 1) -> dict:
        """`repeats` greedy generations of the prompt: ms_per_token_runs and ttft_ms_runs, one value each."""
        return self._ask(dict(repeats=repeats))

    def close(self) -> None:
        if self._p.poll() is None:
            self._p.stdin.close()
            try:
                self._p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait()
        self._err.close()


def _generate(llm, prompt: list[int], output_len: int) -> tuple[float, float]:
    """One greedy generation from a fresh context: (decode ms per token, ms to the first token)."""
    llm.reset()
    t0 = time.perf_counter()
    first, n = None, 0
    for _tok in llm.generate(prompt, temp=0.0, reset=True):
        n += 1
        if first is None:
            first = time.perf_counter()
        if n == output_len:
            break
    return 1e3 * (time.perf_counter() - first) / (n - 1), 1e3 * (first - t0)


def _worker() -> None:
    """Serve `Peer`: the first line of stdin is the job (load the model, warm it up with one short generation, as
    latency.py warms its engines up, and answer its identity); each later line {"repeats": r} is answered with
    that many timed generations; a closed stdin ends it. One JSON line per answer on stdout."""
    import llama_cpp
    job = json.loads(sys.stdin.readline())
    llm = llama_cpp.Llama(model_path=job["path"], n_ctx=job["n_ctx"], n_threads=job["n_threads"], verbose=False)
    _generate(llm, job["prompt"], min(8, job["output_len"]))  # warm-up: the file's pages and the threads
    print(json.dumps(dict(version=llama_cpp.__version__, n_threads=job["n_threads"],
                          system_info=llama_cpp.llama_print_system_info().decode())), flush=True)
    while line := sys.stdin.readline():
        runs = [_generate(llm, job["prompt"], job["output_len"]) for _ in range(json.loads(line)["repeats"])]
        print(json.dumps(dict(ms_per_token_runs=[r[0] for r in runs], ttft_ms_runs=[r[1] for r in runs])), flush=True)


if __name__ == "__main__":
    _worker()
