"""The pure batched sampler that runs inside the step (the host half, SamplingParams, is
`jaxpaged/core/sampling_params.py`).

Every slot carries its own parameters. A slot's random key is `fold_in(key(seed), index of the token
being generated)`, so a request's samples depend only on its own seed and tokens, never on the batch.
What the logprobs describe is the engine's `logprobs_mode` (vLLM's names): "raw_logprobs" (the default:
log_softmax of the model's logits, before logit controls, penalties, temperature and filtering),
"raw_logits" (those logits themselves), "processed_logprobs" (log_softmax of the distribution the token
was drawn from: logit bias, bad words, penalties, `min_tokens` bans, grammar / allowed-token masks, then
temperature, min-p and top-k, then top-p over the tokens those keep; a greedy row has no temperature and no
filter, its distribution being the argmax of the controlled logits) and "processed_logits" (those processed
logits). Masked tokens are -inf in the processed modes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def _penalize(logits, h):
    """vLLM's penalties from the token history: repetition over prompt+output, the others output only."""
    S, V = logits.shape
    hist, plen, hlen = h["history"], h["prompt_len"], h["history_len"]  # [S, M], [S], [S]
    pos = jnp.arange(hist.shape[1])[None, :]
    ids = jnp.where((pos < hlen[:, None]) & (hist >= 0), hist, V)  # V = dropped
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], ids.shape)
    is_out = (pos >= plen[:, None]).astype(jnp.int32)
    counts = jnp.zeros((S, V), jnp.int32).at[rows, ids].add(is_out, mode="drop")  # output counts
    seen = jnp.zeros((S, V), jnp.bool_).at[rows, ids].set(True, mode="drop")  # prompt or output
    rep = h["repetition_penalty"][:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - h["frequency_penalty"][:, None] * counts
    return logits - h["presence_penalty"][:, None] * (counts > 0)


def _apply_bitmask(logits, bitmask):
    """Mask to -inf the tokens whose bit is 0. bitmask i32[S, W]: bit j of word w is token 32*w + j."""
    S, V = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V].astype(jnp.bool_)  # [S, V]
    return jnp.where(allowed, logits, _NEG_INF)


def _apply_bias(logits, ids, values):
    """Add values f32[S, NB] to the logits of ids i32[S, NB] (-1 = none): logit_bias and bad-word bans."""
    S, V = logits.shape
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], ids.shape)
    return logits.at[rows, jnp.where(ids >= 0, ids, V)].add(values, mode="drop")


def _filter(scaled, sp):
    """Mask tokens outside top_k / top_p / min_p (per slot) to -inf, in vLLM's order (Tunix's `sample_top_p` too):
    min_p (p >= min_p * p_max) and top_k first, then top_p over the softmax of the tokens those two keep,
    renormalised. scaled: [S, V] logits/temperature."""
    V = scaled.shape[1]
    srt = -jnp.sort(-scaled, axis=-1)  # [S, V] descending
    k = jnp.where(sp["top_k"] > 0, jnp.minimum(sp["top_k"], V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)  # [S, 1]
    mth = srt[:, :1] + jnp.log(jnp.maximum(sp["min_p"][:, None], 1e-38))  # [S, 1] p >= min_p * p_max
    lower = jnp.maximum(kth, jnp.where(sp["min_p"][:, None] > 0, mth, -jnp.inf))  # [S, 1] top_k and min_p
    probs = jax.nn.softmax(jnp.where(srt >= lower, srt, _NEG_INF), axis=-1)  # [S, V] over what they keep
    cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
    keep_sorted = (cum < sp["top_p"][:, None]) | (sp["top_p"][:, None] >= 1.0)  # 1: all (cum may round to 1)
    n_keep = jnp.maximum(keep_sorted.sum(-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)  # [S, 1]
    return jnp.where(scaled >= jnp.maximum(lower, pth), scaled, _NEG_INF)


def slot_rows(sp: dict, at, num_slots: int) -> dict:
    """The sampler's inputs for rows of the slots `at` i32[R]: every per-slot array (leading axis
    num_slots) gathered, the flags (0-d) kept."""
    return {k: v[at] if jnp.ndim(v) and v.shape[0] == num_slots else v for k, v in sp.items()}


def controlled_logits(logits, sp):
    """The logits after the logit controls: logit_bias / bad-word bans, penalties, `banned` ids, the grammar
    and allowed-token bitmask (per slot; f32[S, V] -> f32[S, V], masked tokens -inf)."""
    S, V = logits.shape
    logits = jax.lax.cond(sp["any_bias"], _apply_bias, lambda l, i, v: l, logits, sp["bias_ids"],
                          sp["bias_values"])
    logits = jax.lax.cond(sp["any_penalty"], _penalize, lambda l, h: l, logits, sp)
    banned = sp["banned"]
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], banned.shape)
    logits = logits.at[rows, jnp.where(banned >= 0, banned, V)].set(_NEG_INF, mode="drop")
    return jax.lax.cond(sp["any_mask"], _apply_bitmask, lambda l, m: l, logits, sp["bitmask"])


def processed_logits(controlled, sp):
    """What a sampled row draws from: controlled logits / temperature, filtered by top-k / top-p / min-p
    (softmax of it is the row's distribution); greedy rows (temperature 0) keep the controlled logits."""
    temp = jnp.where(sp["temperature"] > 0, sp["temperature"], 1.0)
    scaled = jax.lax.cond(sp["any_filter"], _filter, lambda s, _: s, controlled / temp[:, None], sp)
    return jnp.where(sp["temperature"][:, None] > 0, scaled, controlled)


def jnp_argmax(x):
    """i32[...] index of each row's largest value of x [..., V]: XLA's (the default `argmax` of `sample`)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def sample(logits, sp, num_logprobs: int, logprobs_mode: str = "raw_logprobs", argmax=jnp_argmax):
    """Sample one token per slot.

    logits f32[S, V]; sp: dict of per-slot arrays — temperature f32[S], top_k i32[S], top_p f32[S],
    min_p f32[S], seed u32[S], gen_index i32[S], banned i32[S, NB] (ids masked, -1 = none),
    history i32[S, M], prompt_len/history_len i32[S], presence/frequency/repetition_penalty f32[S],
    bitmask i32[S, ceil(V/32)] (grammar and allowed_token_ids masks: 0 bits are masked, all ones when
    unconstrained), bias_ids i32[S, NB] / bias_values f32[S, NB] (logit_bias and bad-word bans, -1 = none),
    any_penalty, any_filter, any_mask, any_bias, all_greedy, any_logprobs: bool[].
    logprobs_mode (static): one of config.LOGPROBS_MODES, what the returned logprobs describe (module docstring).
    argmax (static): the greedy rows' argmax over [S, V] (`jnp_argmax`, or the CPU kernel's, the same result).
    Returns tokens i32[S], token_logprob f32[S], top_logprobs f32[S, K], top_ids i32[S, K] (the last three
    zeros when no slot asked for logprobs: any_logprobs false).
    """
    S = logits.shape[0]
    # the common step, greedy rows and no logit control, takes the argmax of the logits as they are; any
    # other runs the controls. Both branches return the tokens, never the [S, V] logits: a conditional that
    # passes a large array through (an identity branch) copies it every step
    plain = sp["all_greedy"] & ~(sp["any_bias"] | sp["any_penalty"] | sp["any_mask"] | jnp.any(sp["banned"] >= 0))

    def controlled_tokens(raw):
        logits = controlled_logits(raw, sp)
        greedy_tok = argmax(logits)

        def sampled(logits):
            scaled = processed_logits(logits, sp)

            def one(seed, idx, row):
                key = jax.random.fold_in(jax.random.key(seed), idx)
                return jnp.argmax(row + jax.random.gumbel(key, row.shape, row.dtype))
            drawn = jax.vmap(one)(sp["seed"], sp["gen_index"], scaled).astype(jnp.int32)
            return jnp.where(sp["temperature"] > 0, drawn, greedy_tok)
        return jax.lax.cond(sp["all_greedy"], lambda l: greedy_tok, sampled, logits)

    tokens = jax.lax.cond(plain, argmax, controlled_tokens, logits)

    def logprobs(raw, tokens):  # log_softmax and top-k over [S, V] cost ms a step on CPU: only when asked
        # raw modes: the model's logits, before bias, penalties, masks and temperature; processed: after
        source = raw if logprobs_mode.startswith("raw") else controlled_logits(raw, sp)
        lp = processed_logits(source, sp) if logprobs_mode.startswith("processed") else source
        lp = jax.nn.log_softmax(lp, axis=-1) if logprobs_mode.endswith("logprobs") else lp
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_lp, top_ids.astype(jnp.int32)

    def not_asked(source, tokens):
        return (jnp.zeros((S,), source.dtype), jnp.zeros((S, num_logprobs), source.dtype),
                jnp.zeros((S, num_logprobs), jnp.int32))

    tok_lp, top_lp, top_ids = jax.lax.cond(sp["any_logprobs"], logprobs, not_asked, logits, tokens)
    return tokens, tok_lp, top_lp, top_ids
