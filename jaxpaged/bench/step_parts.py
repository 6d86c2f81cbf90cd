"""Where a lone request's decode step goes: the engine's step against its parts run alone.

    jaxpaged bench step_parts --dtype float32 --json docs/results/step_parts_float32.json

The whole step is the engine's (ms per step of one decoding request, `--tokens` rows: the smallest token
bucket, 8 by default). Its parts are jitted functions on the same shapes, dtype and weights, timed alone
(median of `--repeats`):
- `layer_products_ms`: every layer's seven products (q, k, v, o, gate, up, down; the stacked weights
  read by a `lax.scan` over layers, as the step reads them), `--tokens` rows;
- `lm_head_ms`: the head (the tied embedding transposed, or lm_head), `--tokens` rows;
- `read_all_weights_ms`: a pass that only reads every parameter once (a sum): the bandwidth bound;
- `rest_ms`: the step less the products and the head: attention, norms, RoPE, the sampler, the host.
Dense models with Llama's parameter names only (MoE layers are not split out). docs/benchmarks.md ("A
lone request") gives the figures and what they say.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jaxpaged.bench import common as bc
from jaxpaged.bench import timing

PRODUCTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def median_ms(fn, *args, repeats: int) -> float:
    return 1e3 * float(np.median(timing.samples(fn, *args, reps=repeats)))


def part_functions(params: dict, cfg, rows: int, dtype) -> dict:
    """name -> (jitted function, its arguments) for each part the step is split into."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.quant import dot
    missing = [k for k in PRODUCTS if k not in params["layers"]]
    if missing:
        raise SystemExit(f"--model: the layers have no {', '.join(missing)} (dense Llama-style models only)")
    layers = {k: params["layers"][k] for k in PRODUCTS}
    x = jnp.full((rows, cfg.hidden_size), 0.01, dtype)  # [rows, D]

    def products(layers, x):
        def body(acc, layer):  # the shapes of one layer's products; values chained so none is dropped
            h = x + acc
            q, k, v = dot(h, layer["wq"]), dot(h, layer["wk"]), dot(h, layer["wv"])
            o = dot(q, layer["wo"])
            d = dot(dot(h + o, layer["w_gate"]) * dot(h + o, layer["w_up"]), layer["w_down"])
            return acc + d + k.sum() + v.sum(), None
        return jax.lax.scan(body, jnp.zeros_like(x), layers)[0]

    tied = cfg.tie_word_embeddings
    head = params["embed"] if tied else params["lm_head"]
    return dict(layer_products_ms=(jax.jit(products), (layers, x)),
                lm_head_ms=(jax.jit(lambda w, x: dot(x, w, jnp.float32, transpose=tied)), (head, x)),
                read_all_weights_ms=(jax.jit(lambda t: sum(jnp.sum(a.astype(jnp.float32))
                                                           for a in jax.tree.leaves(t))), (params,)))


def lone_step_ms(engine, output_len: int) -> float:
    """ms per step of one request decoding `output_len` greedy tokens (its prefill and first step excluded)."""
    from jaxpaged import SamplingParams
    engine.add_request("parts", {"prompt_token_ids": list(range(10, 26))},
                       SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    n, t = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    return 1e3 * (time.perf_counter() - t) / max(n, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8, help="rows of the parts (the smallest token bucket)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    bc.add_engine_args(ap, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024, num_kv_blocks=200)
    args = ap.parse_args(argv)
    llm = bc.build_llm(bc.resolve_model(args.model), args)
    eng = llm.engine
    out = {name: median_ms(fn, *a, repeats=args.repeats)
           for name, (fn, a) in part_functions(eng.runner.params, eng.model_config, args.tokens,
                                                                     eng.runner.dtype).items()}
    out["step_ms"] = lone_step_ms(eng, args.output_len)
    out["rest_ms"] = out["step_ms"] - out["layer_products_ms"] - out["lm_head_ms"]
    import jax
    out.update(weight_bytes=int(sum(a.nbytes for a in jax.tree.leaves(eng.runner.params))), dtype=args.dtype,
               tokens=args.tokens, load_average=os.getloadavg(), machine=bc.machine_info())
    print(bc.table([[k, out[k]] for k in ("step_ms", "layer_products_ms", "lm_head_ms", "rest_ms",
                                          "read_all_weights_ms")], ["part", "ms"]))
    bc.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
