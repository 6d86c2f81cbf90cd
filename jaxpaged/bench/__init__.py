"""Benchmarks and measuring tools, run as `jaxpaged bench WHAT [flags]` (or `python -m jaxpaged.bench.WHAT`).

Each command is a module here with `main(argv)`; `jaxpaged bench WHAT --help` says what it measures.
The modules beside them are what the commands share: `common` (engine flags, seeded workloads, the engine
driver, JSON output with the machine it ran on), `timing` (the one timer), `roofline`, the vLLM peers' workers
and the compile-only harnesses (`gpu_compile`, `tpu_aot`); tiny models and golden prompts come from
`jaxpaged.testing`. The commands reach the engine through its public names (the step through
`ModelRunner.wrap_steps`) and write their results only where their flags (`--json`, `--out`, `--out-dir`) say,
relative to the current directory. The engine never imports this package.
"""
from __future__ import annotations

import importlib

COMMANDS = {  # WHAT -> what it measures (the module's docstring says how)
    "latency": "ms per output token at 1-8 concurrent requests, beside the peers and the weight-read time",
    "throughput": "offline throughput of one seeded workload on several backends, side by side",
    "serving": "load generator for an OpenAI-compatible server (what vLLM's `bench serve` reports)",
    "serving_vs_vllm": "`jaxpaged serve` against vLLM's server on the same model and loads, side by side",
    "spec": "speculative decoding (n-gram or draft model) against plain decoding",
    "quality": "quantized weights and KV caches against the model's own float32 run",
    "startup": "cold vs warm time to first token, each in a fresh process",
    "memory": "KV memory under a fixed budget: the paged pool against a contiguous allocation",
    "prefix": "a shared system prompt: TTFT and throughput with prefix caching on and off",
    "host": "host overhead per decode step, and decode efficiency against a plain matmul",
    "kv_cache": "decode step time by kv_cache_dtype, A/B in one run",
    "step_parts": "a decode step's parts at 1 and 64 running: products, attention, XLA's own, host, profiler, faults",
    "step_message": "bytes the multi-host leader sends per step",
    "grammar": "grammar mask cost on the host: xgrammar vs llguidance, and the per-step mask fill",
    "research": "what the research hooks cost, and how long update_weights takes",
    "tunix_rollout": "the rollout phase of one GRPO step: JaxpagedRollout against Tunix's vanilla sampler",
    "tunix_grpo": "a few Tunix GRPO steps, rolling out through jaxpaged and through Tunix's vanilla sampler",
    "lora": "LoRA serving cost over random adapters, and the batched product",
    "rl": "the costs of the RL controls, side by side in one run",
    "families": "compile time per family, MoE against dense, the blocks a sliding window frees",
    "tp_check": "tensor-parallel correctness: greedy tokens at TP=N equal TP=1",
    "roofline": "this machine's matmul rate and memory bandwidth",
    "kernels": "the Pallas paged-attention kernels on the GPU at hand",
    "cpu_attention": "one layer's decode attention: the C++ CPU kernel against the plain-JAX reference",
    "cpu_matmul": "a model size's bfloat16 weight products: the C++ CPU kernel per ISA path against XLA's dot",
    "tpu_kernel": "the Mosaic TPU ragged kernel on the TPU at hand",
    "gpu_compile_table": "compile-only for sm_90a: kernels and whole steps, memory and predicted step time",
    "tpu_compile_table": "compile-only for TPU v5e / v6e: whole steps, memory and predicted step time",
    "tpu_kernel_compare": "compile-only: our Mosaic TPU kernel against JAX's shipped one",
    "plot": "PNG figures from the benchmarks' JSON files",
}


def run(what: str, argv: list[str]) -> int:
    """Run command `what` with its flags `argv`; the exit status (0 unless the command returns one)."""
    rc = importlib.import_module(f"jaxpaged.bench.{what}").main(argv)
    return rc if isinstance(rc, int) else 0
