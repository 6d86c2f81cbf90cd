"""A roofline for the decode step: its FLOPs and bytes against this machine's measured matmul rate and
memory bandwidth (used by host.py; also runnable alone for the micro-benchmarks).

    jaxpaged bench roofline            # the micro-benchmarks only

Per decode step of N running requests with mean context c (tokens already in the pool):
  FLOPs          N x (2 x matmul parameters read per token, the logits included
                      + 4 x layers x query heads x head_dim x c for attention's two products)
  weights read   every parameter byte once (as stored: int8 / fp8 bytes and their scales when quantized),
                 except the embedding of an untied model, of which only N rows are gathered
  KV read        N x (c rounded up to whole blocks: attention reads whole blocks) x KV bytes per token
  KV written     N x KV bytes per token (this step's K and V)
KV bytes per token are read from the engine's pools (every pool array: their bytes / token positions),
so a narrower KV cache (and its scales) counts as it is stored.
Then: % of the matmul rate = FLOPs / step time / matmul rate; % of the bandwidth = bytes / step time /
bandwidth; the roofline time = max(FLOPs / matmul rate, bytes / bandwidth), and roofline efficiency =
roofline time / step time. The bandwidth is the larger of the two measured below (XLA's CPU sum may
not saturate memory on its own).

Micro-benchmarks (same process, same dtype, best of --reps): the matmul rate of a jitted square
jnp.dot (2048^3), and the read bandwidth of a jitted sum over a 256 MiB array (with the copy bandwidth,
read + write, of x * 2 in place over it beside it).
"""
from __future__ import annotations

import argparse

from jaxpaged.bench import timing


def _best(fn, *args, reps: int) -> float:
    return min(timing.samples(fn, *args, reps=reps))


def machine_peaks(dtype: str = "float32", reps: int = 5, matmul_n: int = 2048, mib: int = 256) -> dict:
    """Measured matmul FLOP/s (square jnp.dot of matmul_n) and memory bytes/s (sum over `mib` MiB: read;
    x * 2: read + write)."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (matmul_n, matmul_n), dtype)
    # as the engine multiplies: 16-bit inputs accumulate in float32 (quant.dot), which XLA CPU runs natively
    t_mm = _best(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)), a, a, reps=reps)
    x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
    t_read = _best(jax.jit(jnp.sum), x, reps=reps)
    double = jax.jit(lambda v: v * 2, donate_argnums=0)  # in place: no fresh pages to fault in
    y = [double(jnp.ones_like(x))]

    def again():  # the same buffer each call, donated
        y[0] = double(y[0])
        return y[0]
    t_copy = min(timing.samples(again, reps=reps, warmup=0))
    read, copy = x.nbytes / t_read, 2 * x.nbytes / t_copy
    return dict(dtype=dtype, matmul_flops_per_s=2 * matmul_n ** 3 / t_mm, read_bytes_per_s=read,
                copy_bytes_per_s=copy, bandwidth_bytes_per_s=max(read, copy), matmul_n=matmul_n, array_mib=mib)


def matmul_params_per_token(mc) -> int:
    """Matrix parameters one token multiplies by (MoE: its k experts and the router), the lm_head included."""
    D, V = mc.hidden_size, mc.vocab_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    mlp = 3 * D * mc.intermediate_size
    if mc.num_experts:
        mlp = mc.num_experts_per_tok * 3 * D * mc.moe_intermediate_size + D * mc.num_experts
    return mc.num_layers * (2 * D * q + 2 * D * kv + mlp) + D * V


def step_model(engine, N: int, context: float) -> dict:
    """FLOPs and bytes of one decode step of `engine` (an LLMEngine) with N requests of mean context."""
    import jax
    mc, runner = engine.model_config, engine.runner
    leaves = jax.tree.leaves(runner.params)
    weights = sum(a.nbytes for a in leaves)
    if not mc.tie_word_embeddings:  # only N rows of the embedding are gathered
        embed = sum(a.nbytes for a in jax.tree.leaves(runner.params["embed"]))
        weights += N * embed / mc.vocab_size - embed
    pools = jax.tree.leaves((runner.k_pool, runner.v_pool))  # values (and scales of a quantized KV cache)
    bs = runner.block_size
    kv_per_token = sum(a.nbytes for a in pools) / (pools[0].shape[0] * bs) * mc.num_layers
    read_tokens = -(-context // bs) * bs
    flops = N * (2 * matmul_params_per_token(mc) + 4 * mc.num_layers * mc.num_heads * mc.head_dim * context)
    return dict(flops=float(flops), weight_bytes=float(weights), kv_read_bytes=float(N * read_tokens * kv_per_token),
                kv_write_bytes=float(N * kv_per_token), kv_bytes_per_token=float(kv_per_token))


def attach(model: dict, step_s: float, peaks: dict) -> dict:
    """The step model of one N with its measured step time against the machine's peaks."""
    total = model["weight_bytes"] + model["kv_read_bytes"] + model["kv_write_bytes"]
    t_compute = model["flops"] / peaks["matmul_flops_per_s"]
    t_memory = total / peaks["bandwidth_bytes_per_s"]
    return dict(model, bytes=total, step_s=step_s, flops_per_s=model["flops"] / step_s,
                bytes_per_s=total / step_s,
                pct_matmul_rate=100 * model["flops"] / step_s / peaks["matmul_flops_per_s"],
                pct_bandwidth=100 * total / step_s / peaks["bandwidth_bytes_per_s"],
                roofline_s=max(t_compute, t_memory), bound="compute" if t_compute >= t_memory else "memory",
                roofline_efficiency_pct=100 * max(t_compute, t_memory) / step_s)


def report(rows: list[dict], peaks: dict) -> str:
    """The roofline table (rows: {running, roofline: attach(...)})."""
    from jaxpaged.bench.common import table
    g, m = 1e9, 1e6
    head = (f"machine: matmul {peaks['matmul_flops_per_s'] / g:.1f} GFLOP/s ({peaks['dtype']}), read "
            f"{peaks['read_bytes_per_s'] / g:.1f} GB/s, copy {peaks['copy_bytes_per_s'] / g:.1f} GB/s")
    body = [[r["running"], r["roofline"]["flops"] / g, r["roofline"]["weight_bytes"] / m,
             r["roofline"]["kv_read_bytes"] / m, r["roofline"]["kv_write_bytes"] / m,
             1e3 * r["roofline"]["step_s"], r["roofline"]["pct_matmul_rate"], r["roofline"]["pct_bandwidth"],
             r["roofline"]["bound"], r["roofline"]["roofline_efficiency_pct"]] for r in rows]
    return head + "\n" + table(body, ["running", "GFLOP", "weights MB", "KV read MB", "KV written MB",
                                      "step ms", "% matmul rate", "% bandwidth", "bound", "% of roofline"])


def main(argv=None) -> dict:
    """The micro-benchmarks alone: this machine's matmul rate and read / copy bandwidth."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    p = machine_peaks(args.dtype, args.reps)
    print(f"matmul {p['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, read {p['read_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"copy {p['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    return p


if __name__ == "__main__":
    main()
