"""Device half: the target's verification of each slot's proposals, inside the compiled step.

A speculating slot's chunk is [last token, d_1 .. d_m] (m <= K proposals); its rows give the target's
distributions p_0 .. p_m for the tokens after each. At every row the plain sampler (`sampler.sample`)
draws the target's token x_j with the request's own key for that position, `fold_in(key(seed), g + j)`
(g: the index of the token the request generates next), and the proposals are accepted while x_j = d_(j+1);
the output is x_0 .. x_a, a = the number accepted. Greedy rows: the longest matching prefix of argmaxes,
plus the target's next token.

This is rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for a proposer that puts all its
mass on d (n-gram lookup; q = one-hot): d is accepted with probability min(1, p(d) / q(d)) = p(d) =
P(x = d), and on rejection the token is x conditioned on x != d, i.e. normalize(max(0, p - q)). So every
position keeps the target's distribution exactly, and since the keys are those a plain run uses, a
seeded request produces the very tokens it produces without speculation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.spec_decode.positions import position_rows, proposal_rows
from jaxpaged.spec_decode.rejection import rejection_sample
from jaxpaged.step.sampler import controlled_logits, processed_logits, sample


def accepted_prefix(target, drafts, num_drafts):
    """The number of proposals accepted per row: i32[R] = length of the prefix where target = drafts.

    target i32[R, K+1] (the target's tokens at each position), drafts i32[R, K], num_drafts i32[R]."""
    K = drafts.shape[1]
    match = (target[:, :K] == drafts) & (jnp.arange(K)[None, :] < num_drafts[:, None])  # [R, K]
    return jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1)


def verify_rows(logits_fn, h, batch: dict, sp: dict, num_spec: int, num_logprobs: int,
                logprobs_mode: str = "raw_logprobs"):
    """Tokens and logprobs of the step's R = len(sample_slots) rows, K + 1 = num_spec + 1 positions each.

    logits_fn: hidden [N, D] -> logits f32[N, V] (lm_head, sharding constraints). batch: logits_indices
    i32[S] (each slot's last row), sample_slots i32[R], draft_tokens i32[S, K], num_drafts i32[S],
    min_tokens i32[S]; sp as `sampler.sample` takes it, per slot, with the per-position arrays of
    positions.py, and draft_probs f32[S, K, V] when the proposer has a full distribution q (a draft model):
    then rows are verified by `rejection_sample`; logprobs_mode as `sample` takes it.
    Returns tokens i32[R, K+1] (-1 past each row's output: a + 1 tokens), token_logprob f32[R, K+1],
    top_logprobs f32[R, K+1, NL], top_ids i32[R, K+1, NL]. The runner compiles this verifying step beside
    the plain one and runs it only when some scheduled request proposes (runner.variants)."""
    K1 = num_spec + 1
    sp = dict(sp)
    q = sp.pop("draft_probs", None)                                   # f32[S, K, V] or absent (one-hot)
    S, rows = batch["logits_indices"].shape[0], batch["sample_slots"]
    at = jnp.minimum(rows, S - 1)                                     # [R]
    R = at.shape[0]

    nd = batch["num_drafts"][at]                                      # [R]
    j = jnp.arange(K1)[None, :]                                       # [1, K+1]
    tok_rows = proposal_rows(batch["logits_indices"][at], nd, K1)  # [R, K+1] (past m: the last row again)
    prow = position_rows(sp, batch, at, num_spec)                 # each position's key, bans, history, masks
    # lm_head and the sampler run only on the N real positions (a slot's last token and its m proposals,
    # packed in front): at most one per scheduled token, so N = min(T, R*(K+1)) rows, not R*(K+1)
    real = ((j <= nd[:, None]) & (rows < S)[:, None]).reshape(-1)  # [R*(K+1)]
    sel = jnp.nonzero(real, size=min(h.shape[0], R * K1), fill_value=R * K1)[0]  # [N] (R*(K+1): none)
    pick = jnp.minimum(sel, R * K1 - 1)
    logits = logits_fn(h[tok_rows.reshape(-1)[pick]])             # [N, V]
    drawn = sample(logits, _rows_at(prow, pick, R * K1), num_logprobs, logprobs_mode)
    tokens, *lps = (_unpack(a, sel, R, K1) for a in drawn)        # [R, K+1, ...] (unused positions: 0)
    if q is None:  # proposals with all their mass on one token (n-gram): the longest matching prefix
        a = accepted_prefix(tokens, batch["draft_tokens"][at], nd)  # [R]
        return (jnp.where(j <= a[:, None], tokens, -1), *lps)
    # proposals drawn from a full distribution q (a draft model, raw logprobs only: config.check_draft_engine):
    # rejection sampling (rejection.py) on the target's distributions p at every position
    logits = _unpack(logits, sel, R, K1).reshape(R * K1, -1)         # [R*(K+1), V]
    p = jax.nn.softmax(processed_logits(controlled_logits(logits, prow), prow), axis=-1)
    out = rejection_sample(p.reshape(R, K1, -1), q[at], batch["draft_tokens"][at], nd, tokens,
                           sp["seed"][at], sp["gen_index"][at], sp["temperature"][at] <= 0)
    tok_lp = jax.lax.cond(sp["any_logprobs"], lambda: jnp.take_along_axis(  # of the tokens output
        jax.nn.log_softmax(logits, axis=-1), jnp.maximum(out, 0).reshape(-1, 1), axis=-1).reshape(R, K1),
        lambda: lps[0])
    return (out, tok_lp, *lps[1:])


def _rows_at(prow: dict, pick, num_rows: int) -> dict:
    """The per-row sampler inputs (leading axis num_rows) at rows `pick` i32[N]; the flags (0-d) kept."""
    return {k: v[pick] if jnp.ndim(v) and v.shape[0] == num_rows else v for k, v in prow.items()}


def _unpack(a, sel, R: int, K1: int):
    """[N, ...] values of the packed positions `sel` -> [R, K+1, ...], zeros where no position was computed."""
    full = jnp.zeros((R * K1,) + a.shape[1:], a.dtype).at[sel].set(a, mode="drop")
    return full.reshape((R, K1) + a.shape[1:])
