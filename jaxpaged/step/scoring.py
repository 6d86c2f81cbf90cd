"""Scoring: the logprobs of given tokens, by one dense forward over whole sequences (`LLM.score`).

`dense_logprobs` is a pure function for research: it runs the engine's own `decoder` (the same layer
code as generation) over R sequences of L tokens, one sequence per row of a block table into a scratch
KV pool made inside the call, then `lm_logits` and log_softmax. No engine state is read or written, so
it can run beside a serving engine on the same parameters. `score` drives it for `LLM.score`: pairs are
grouped into calls of bounded shape (L a power of two rounded up to the block size, R a power of two,
R * L at most max(max_num_batched_tokens, L)), so each shape compiles once.
"""
from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpaged.core.validation import InvalidParam, check_text, prompt_ids
from jaxpaged.models.llama import decoder, lm_logits
from jaxpaged.step.attention import make_attention
from jaxpaged.step.mesh import MODEL_AXIS, POOL_SPEC


def dense_logprobs(params, cfg, tokens, attn_fn, *, block_size: int, pool_sharding=None):
    """tokens i32[R, L] (L a multiple of block_size) -> f32[R, L]: entry [r, t] is the logprob of
    tokens[r, t + 1] after tokens[r, :t + 1] (the last column is 0). Rows are independent; a row's padding
    after its real tokens changes nothing before it (attention is causal)."""
    R, L = tokens.shape
    nb = L // block_size
    num_blocks = R * nb + 1  # block 0 stays the null block
    dtype = params["embed"].dtype
    shape = (cfg.num_layers * num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    k_pool, v_pool = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if pool_sharding is not None:
        k_pool, v_pool = (jax.lax.with_sharding_constraint(p, pool_sharding) for p in (k_pool, v_pool))
    tables = 1 + jnp.arange(R * nb, dtype=jnp.int32).reshape(R, nb)  # [R, nb]
    pos = jnp.tile(jnp.arange(L, dtype=jnp.int32), R)  # [R*L]
    rows = jnp.repeat(jnp.arange(R, dtype=jnp.int32), L)
    batch = dict(input_ids=tokens.reshape(-1), positions=pos,
                 slot_mapping=tables[rows, pos // block_size] * block_size + pos % block_size,
                 block_tables=tables, seq_lens=jnp.full(R, L, jnp.int32),
                 query_start_loc=jnp.arange(R + 1, dtype=jnp.int32) * L)
    h, _, _ = decoder(params, cfg, k_pool, v_pool, batch, attn_fn)  # [R*L, D]
    lp = jax.nn.log_softmax(lm_logits(params, cfg, h), axis=-1).reshape(R, L, -1)  # [R, L, V]
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((R, 1), tokens.dtype)], axis=1)  # [R, L]
    out = jnp.take_along_axis(lp, nxt[:, :, None], axis=-1)[:, :, 0]
    return jnp.where(jnp.arange(L) < L - 1, out, 0.0)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _continuation_ids(c, tokenizer, model_dir) -> list[int]:
    if isinstance(c, str):
        if tokenizer is None:
            raise InvalidParam("continuations", f"{model_dir} has no tokenizer files: give continuations as "
                                                "lists of token ids")
        check_text("continuations", c)
        return tokenizer.encode(c, add_special_tokens=False)
    if not isinstance(c, (list, tuple)) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                   for t in c):
        raise InvalidParam("continuations", "each continuation must be a string or a list of token ids, got "
                                            f"{type(c).__name__}")
    return [int(t) for t in c]


def score(engine, prompts, continuations) -> list[list[float]]:
    """Per-token logprobs of each continuation after its prompt (see `LLM.score`)."""
    if len(prompts) != len(continuations):
        raise InvalidParam("continuations", f"{len(continuations)} continuations for {len(prompts)} prompts")
    runner, V, M = engine.runner, engine.model_config.vocab_size, engine.max_model_len
    seqs = []
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        _, pids = prompt_ids(p, engine.tokenizer, engine.model_dir)
        cids = _continuation_ids(c, engine.tokenizer, engine.model_dir)
        for name, ids in (("prompt", pids), ("continuations", cids)):
            if not ids:
                raise InvalidParam(name, f"{name} {i} is empty (it has no tokens)")
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise InvalidParam(name, f"{name} {i}: token id {bad[0]} is out of vocabulary (vocab_size {V})")
        if len(pids) + len(cids) > M:
            raise InvalidParam("continuations", f"prompt {i} and its continuation have {len(pids) + len(cids)} "
                                                f"tokens; max_model_len is {M}")
        seqs.append((pids, cids))
    bs = runner.block_size
    fn = _compiled(runner)
    out: list[list[float] | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    while order:
        longest = len(seqs[order[-1]][0]) + len(seqs[order[-1]][1])
        L = -(-_pow2(longest) // bs) * bs
        rows = max(1, min(runner.cfg.max_num_seqs, max(runner.cfg.max_num_batched_tokens, L) // L))
        rows = min(1 << (rows.bit_length() - 1), _pow2(len(order)))  # a power of two
        take, order = order[-rows:], order[:-rows]
        tokens = np.zeros((rows, L), np.int32)
        for r, i in enumerate(take):
            ids = seqs[i][0] + seqs[i][1]
            tokens[r, :len(ids)] = ids
        lp = np.asarray(fn(runner.params, tokens=tokens))
        for r, i in enumerate(take):
            p, c = len(seqs[i][0]), len(seqs[i][1])
            out[i] = lp[r, p - 1:p - 1 + c].tolist()
    return out


_SCORE_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> its jitted dense_logprobs


def _compiled(runner):
    """dense_logprobs jitted for the runner's model, attention backend and mesh (one per runner)."""
    fn = _SCORE_FNS.get(runner)
    if fn is None:
        sharding = NamedSharding(runner.mesh, POOL_SPEC) if runner.mesh.shape[MODEL_AXIS] > 1 else None
        fn = _SCORE_FNS[runner] = jax.jit(functools.partial(
            dense_logprobs, cfg=runner.step_cfg, attn_fn=make_attention(runner.backend, False, runner.mesh),
            block_size=runner.block_size, pool_sharding=sharding), compiler_options=runner.compiler_options)
    return fn
