"""What the research hooks cost, and how long `update_weights` takes (docs/research.md).

    jaxpaged bench research --num-prompts 32 --json results/research.json

Throughput (one seeded workload, continuous batching, greedy): the same model in two engines, one plain and
one compiled with `hidden_state_layers=[0, L/2, L]` and `steering_layers=[L/2]`, run alternately
(--rounds times each, best run kept). Reported as ratios to the plain engine's output tok/s:
  hooks-idle      hooks compiled, no request asks (the cost every user pays for compiling them)
  hooks-steered   every request steered at layer L/2
  hooks-hidden    every request asks for its generated tokens' hidden states (read back every step)
and the time of one compiled step (no request asks) at the smallest and largest bucket, hooks / plain
(alternated calls, fastest of --step-reps each).
update_weights (the default model, whole checkpoint; median of --rounds):
  pytree-device   the engine's own pytree of device arrays (adopted as they are)
  pytree-numpy    the same pytree as numpy arrays (placed on the device)
  hf-pairs        (HF name, numpy array) pairs in the engine dtype (mapped, transposed, stacked, placed)
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from jaxpaged.bench import common as bc


class _Asking:
    """The engine, with every request's SamplingParams changed by `change` (drive builds plain ones)."""

    def __init__(self, engine, change):
        self._engine, self._change = engine, change

    def add_request(self, rid, prompt, params, arrival_time=None):
        return self._engine.add_request(rid, prompt, self._change(params), arrival_time)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def hf_pairs(model_dir: str, dtype: str) -> list:
    """The checkpoint as (HF name, numpy array) pairs: safetensors, or the default model's GGUF."""
    from jaxpaged.checkpoints.weights import NP_DTYPES, is_orbax_dir, read_safetensors, safetensors_files
    if is_orbax_dir(model_dir):
        from jaxpaged.checkpoints.default_model import default_gguf_path
        from jaxpaged.checkpoints.gguf import GGUFModel
        tensors = GGUFModel(default_gguf_path()).tensors()
    else:
        tensors = (t for f in safetensors_files(model_dir) for t in read_safetensors(f))
    return [(n, np.asarray(a).astype(NP_DTYPES[dtype])) for n, a in tensors]


def step_ratios(plain, hooked, reps: int) -> dict:
    """Hooked / plain time of one compiled step (no request asks), per bucket: the calls alternate, the
    fastest of each kept (the least disturbed by other load)."""
    import jax
    out = {}
    for T in (plain.buckets[0], plain.buckets[-1]):
        best = {}
        for _ in range(reps):
            for name, r in (("plain", plain), ("hooked", hooked)):
                inputs = r.device_inputs(*r.dummy_inputs(T))
                t0 = time.perf_counter()
                outs, r.k_pool, r.v_pool = r.compiled_step((T, False))(r.params, r.k_pool, r.v_pool, *inputs)
                jax.block_until_ready(outs)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        out[f"T={T}"] = best["hooked"] / best["plain"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_engine_args(ap, max_num_seqs=32, max_num_batched_tokens=256)
    bc.add_workload_args(ap, num_prompts=32, prompt_len=(32, 128), output_len=(32, 64))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-reps", type=int, default=30, help="calls of each compiled step, alternated")
    args = ap.parse_args(argv)
    model_dir = bc.resolve_model(args.model)
    wl = bc.make_workload(args, model_dir)
    args.max_model_len = args.max_model_len or bc.workload_max_len(args)
    plain = bc.build_llm(model_dir, args)
    L = plain.engine.model_config.num_layers
    mid, D = L // 2, plain.engine.model_config.hidden_size
    hooked = bc.build_llm(model_dir, args, hidden_state_layers=[0, mid, L], steering_layers=[mid])
    vec = np.random.default_rng(0).normal(0, 0.01, D).astype(np.float32)

    def steered(p):
        p.steering_vectors = {mid: vec}
        return p

    def hidden(p):
        p.return_hidden_states = True
        return p
    runs = {"plain": plain.engine, "hooks-idle": hooked.engine, "hooks-steered": _Asking(hooked.engine, steered),
            "hooks-hidden": _Asking(hooked.engine, hidden)}
    vocab = plain.engine.model_config.vocab_size
    for eng in (plain.engine, hooked.engine):
        bc.warm_up(eng, vocab)
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for name, eng in runs.items():
            rec = bc.drive(eng, wl.requests)
            tps = bc.summarize(rec)["output_tokens_per_s"]
            best[name] = max(best.get(name, 0.0), tps)
            bc.say(f"round {r}: {name}: {tps:.1f} output tok/s")
            eng.block_manager.reset_prefix_cache()
    out = {"throughput_output_tok_s": best,
           "ratio_to_plain": {k: v / best["plain"] for k, v in best.items() if k != "plain"},
           "step_ratio_to_plain": step_ratios(plain.engine.runner, hooked.engine.runner, args.step_reps)}

    import jax
    params = hooked.get_weights()
    host = jax.tree.map(np.asarray, params)
    pairs = hf_pairs(model_dir, hooked.engine.config.dtype)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds + 1):
        for name, w in (("pytree-device", params), ("pytree-numpy", host), ("hf-pairs", pairs)):
            t0 = time.perf_counter()
            hooked.update_weights(w)
            jax.block_until_ready(hooked.get_weights())
            times.setdefault(name, []).append(time.perf_counter() - t0)
    out["update_weights_s"] = {k: float(np.median(v[1:])) for k, v in times.items()}  # the first: warm-up
    out["num_tensors"] = len(pairs)
    out["machine"] = bc.machine_info()
    print(bc.table([[k, f"{v:.3f}"] for k, v in out["ratio_to_plain"].items()], ["throughput", "ratio to plain"]))
    print(bc.table([[k, f"{v:.3f}"] for k, v in out["step_ratio_to_plain"].items()], ["step time", "hooks / plain"]))
    print(bc.table([[k, f"{v * 1e3:.1f}"] for k, v in out["update_weights_s"].items()], ["update_weights", "ms"]))
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
