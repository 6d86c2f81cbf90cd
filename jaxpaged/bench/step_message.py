"""Bytes the multi-host leader sends per step (docs/scale-out.md, "Bytes per step"), on one process.

    jaxpaged bench step_message --model DIR --num-kv-blocks 2560 --json results/step_message.json

(defaults: max_num_seqs 64, max_model_len 4096, 48 prompts of 600 tokens, 32 output tokens). The message
depends on those sizes, not on the model's weights: the figures in docs/scale-out.md come from a 2-layer
random Llama whose max_position_embeddings is 4096.

Runs a seeded workload through one engine and encodes every step's inputs exactly as the leader does
(`multihost.encode_step`): reports, for full-budget steps and for decode steps, the raw bytes of the host
arrays, the compressed message, and the time to encode and decode it.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from jaxpaged.bench import common as bc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_workload_args(ap, num_prompts=48, prompt_len=(600, 600), output_len=(32, 32))
    bc.add_engine_args(ap, max_num_seqs=64, max_model_len=4096)
    args = ap.parse_args(argv)
    from jaxpaged.parallel.multihost import decode_step, encode_step

    model_dir = bc.resolve_model(args.model)
    wl = bc.make_workload(args, model_dir)
    llm = bc.build_llm(model_dir, args, max_model_len=args.max_model_len)
    runner = llm.engine.runner
    device_inputs = runner.device_inputs
    host, rows = {}, []  # rows: (T, raw bytes, message bytes, encode s, decode s)

    def record_inputs(batch, sp):
        host["inputs"] = (batch, sp)
        return device_inputs(batch, sp)

    def record_step(key, compiled):  # ModelRunner.wrap_steps: the step about to run, after its inputs
        if "inputs" in host:
            batch, sp = host.pop("inputs")
            raw = sum(np.asarray(v).nbytes for v in [*batch.values(), *sp.values()]
                      if isinstance(v, (np.ndarray, np.generic)))
            t0 = time.perf_counter()
            msg = encode_step(key, batch, sp)
            t1 = time.perf_counter()
            decode_step(msg, runner)
            rows.append((key[0], raw, len(msg), t1 - t0, time.perf_counter() - t1))
        return compiled()

    runner.device_inputs = record_inputs
    runner.wrap_steps(record_step)
    bc.drive(llm.engine, wl.requests)
    a = np.array(rows)
    out = {}
    small = max(args.max_num_seqs, runner.buckets[0])  # buckets a decode step (one token per request) fits
    for name, sel in (("full-budget steps", a[:, 0] == runner.buckets[-1]), ("decode steps", a[:, 0] <= small)):
        x = a[sel]
        if len(x):
            out[name] = dict(steps=len(x), raw_bytes=float(x[:, 1].mean()), message_bytes=float(x[:, 2].mean()),
                             message_bytes_max=float(x[:, 2].max()), encode_ms=float(x[:, 3].mean() * 1e3),
                             decode_ms=float(x[:, 4].mean() * 1e3))
    rows_out = [[k, v["steps"], v["raw_bytes"], v["message_bytes"], v["message_bytes_max"], v["encode_ms"],
                 v["decode_ms"]] for k, v in out.items()]
    print(bc.table(rows_out, ["steps", "n", "raw bytes", "message bytes", "max", "encode ms", "decode ms"]))
    bc.write_json(args.json, dict(workload=wl.info, results=out, engine=bc.engine_kwargs(args)))
    return out


if __name__ == "__main__":
    main()
