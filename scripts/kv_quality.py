"""Quality of a quantized KV cache against the float32 pool: teacher-forced logprobs of the same tokens.

    python scripts/kv_quality.py [--model DIR] [--kv bfloat16 int8 float8_e4m3fn] [--max-tokens 32]

`kv_quality(model_dir, kv_dtypes, prompts, max_tokens)` is the reusable measurement (tests/test_kv_quality.py
asserts the goals with it; a quality report over weight formats can call it too). Method: the float32
engine (float32 weights and KV) generates `max_tokens` greedy tokens per prompt; then, for float32 KV and
each KV dtype, one pure forward pass (the engine's decoder and lm_logits, reference attention) runs over
prompt + those tokens through a paged pool of that dtype. Each layer writes (quantizes) a token's K/V
before its attention reads them, so a single causal pass is the same as decoding token by token with that
pool, teacher-forced on the float32 run's tokens. Reported per dtype, over the generated positions:
  agreement        share of positions whose argmax is the float32 run's (greedy) token
  mean/max |dlp|   |logprob of the chosen token - its logprob with the float32 pool|
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

GOLDEN_TEXTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
                "The capital of Japan is"]  # tests/test_default_model.py's golden prompts


def teacher_forced_logprobs(params, cfg, token_ids: list[int], kv_cache_dtype: str, *, block_size: int = 16,
                            pad_to: int = 128):
    """Log-softmax f32[T, V] at every position of one sequence, its K/V through a pool of kv_cache_dtype
    (the sequence padded to a multiple of `pad_to` rows, so one compilation serves similar lengths)."""
    T = len(token_ids)
    Tp = -(-T // pad_to) * pad_to
    B = Tp // block_size
    ids = np.zeros(Tp, np.int32)
    ids[:T] = token_ids
    slots = np.where(np.arange(Tp) < T, np.arange(Tp) + block_size, 0)  # padding rows -> the null block
    batch = dict(input_ids=ids, positions=np.arange(Tp, dtype=np.int32), slot_mapping=slots.astype(np.int32),
                 block_tables=np.arange(1, B + 1, dtype=np.int32)[None], seq_lens=np.asarray([T], np.int32),
                 query_start_loc=np.asarray([0, T], np.int32))
    return np.asarray(_forward_all(params, batch, cfg=cfg, kv_cache_dtype=kv_cache_dtype, num_blocks=B + 1,
                                   block_size=block_size))[:T]


@functools.partial(jax.jit, static_argnames=("cfg", "kv_cache_dtype", "num_blocks", "block_size"))
def _forward_all(params, batch, *, cfg, kv_cache_dtype, num_blocks, block_size):
    from jaxpaged.step import kv_cache
    from jaxpaged.models.llama import decoder, lm_logits
    from pallas_kernels.reference import ragged_paged_attention_reference
    shape = (cfg.num_layers * num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)  # block 0: the null block
    k_pool = kv_cache.zeros_pool(shape, kv_cache_dtype, jnp.float32)
    v_pool = kv_cache.zeros_pool(shape, kv_cache_dtype, jnp.float32)
    h, _, _ = decoder(params, cfg, k_pool, v_pool, batch, ragged_paged_attention_reference)
    return jax.nn.log_softmax(lm_logits(params, cfg, h), axis=-1)  # [T, V]


def kv_quality(model_dir: str, kv_dtypes=("bfloat16", "int8", "float8_e4m3fn"), prompts=None,
               max_tokens: int = 32) -> dict:
    """kv dtype -> {agreement, mean_abs_dlogprob, max_abs_dlogprob, positions} against the float32 pool."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.config import ModelConfig
    from jaxpaged.checkpoints.weights import load_params
    llm = LLM(model=model_dir, dtype="float32", max_num_seqs=8, max_model_len=512, show_progress=False,
              warmup=False)
    if prompts is None:
        prompts = [llm.tokenizer.encode(t) for t in GOLDEN_TEXTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    seqs = [(list(p), list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    del llm
    cfg = ModelConfig.from_dir(model_dir)
    params = jax.tree.map(jnp.asarray, load_params(model_dir, cfg, "float32"))

    def chosen(kv):  # per sequence: (logprob of each generated token, argmax) at the positions before it
        res = []
        for p, gen in seqs:
            lp = teacher_forced_logprobs(params, cfg, p + gen, kv)[len(p) - 1:-1]  # [G, V]
            res.append((lp[np.arange(len(gen)), gen], lp.argmax(-1)))
        return res

    ref = chosen("auto")
    out = {}
    for kv in kv_dtypes:
        got = chosen(kv)
        d = np.concatenate([np.abs(g[0] - r[0]) for g, r in zip(got, ref)])
        agree = np.concatenate([g[1] == np.asarray(gen) for g, (_, gen) in zip(got, seqs)])
        out[kv] = dict(agreement=float(agree.mean()), mean_abs_dlogprob=float(d.mean()),
                       max_abs_dlogprob=float(d.max()), positions=int(d.size))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded default model (SmolLM2-135M)")
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "int8", "float8_e4m3fn"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import bench_common as bc
    res = kv_quality(bc.resolve_model(args.model), args.kv, max_tokens=args.max_tokens)
    print("| kv_cache_dtype | greedy agreement | mean abs dlogprob | max abs dlogprob |")
    print("| --- | --- | --- | --- |")
    for kv, r in res.items():
        print(f"| {kv} | {100 * r['agreement']:.1f}% | {r['mean_abs_dlogprob']:.4f} | {r['max_abs_dlogprob']:.4f} |")
    bc.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
