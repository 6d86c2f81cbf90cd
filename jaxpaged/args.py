"""Command-line flags shared by `jaxpaged generate | serve | convert` (jaxpaged/cli.py) and the server's
own parser (serve/app.py): one place both import, so neither imports the other."""
from __future__ import annotations

import argparse


def add_scale_out_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Tensor / data parallelism, multi-host and async-scheduling flags (shared by generate and serve)."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices one model is split over")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="replicas, each on its own "
                        "--tensor-parallel-size devices, behind one front (routed by load and prefix)")
    parser.add_argument("--coordinator-address", default=None, help="multi-host: HOST:PORT of process 0 "
                        "(as jax.distributed.initialize); every process gets the same flags")
    parser.add_argument("--num-processes", type=int, default=1, help="multi-host: processes in the job")
    parser.add_argument("--process-id", type=int, default=0, help="multi-host: this process (0 schedules "
                        "and serves, the others follow)")
    parser.add_argument("--distributed-timeout", type=float, default=60.0, help="multi-host: seconds a step "
                        "may take before the leader declares a follower lost (default %(default)s)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare step t+1 while step t runs on the device (default: on for GPU/TPU, off "
                        "on CPU; see docs/architecture.md)")
    parser.add_argument("--speculative-config", default=None, help="speculative decoding, as JSON: "
                        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                        '"prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4}\' '
                        '(default: off)')
    return parser


def add_quantization_arg(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--quantization: weight-only int8 / fp8 (generate, serve, convert)."""
    parser.add_argument("--quantization", default=None, choices=["int8", "fp8"], help="weight-only "
                        "quantization with per-output-channel scales (default: none, the weights' dtype)")
    return parser


def scale_out_kwargs(args) -> dict:
    """EngineConfig fields from the scale-out (and async-scheduling) flags; starts jax.distributed first
    when multi-host."""
    kw = {k: getattr(args, k) for k in ("tensor_parallel_size", "data_parallel_size", "coordinator_address",
                                        "num_processes", "process_id", "distributed_timeout", "async_scheduling",
                                        "speculative_config")}
    if kw["num_processes"] > 1:
        from jaxpaged.parallel.multihost import initialize
        initialize(kw["coordinator_address"], kw["num_processes"], kw["process_id"])
    return kw
