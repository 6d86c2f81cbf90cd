"""Rejection sampling of proposals drawn from a full distribution q (a draft model), on the device.

Leviathan et al. 2023; Chen et al. 2023. At position j the proposal d_j ~ q_j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)) (p_j: the target's distribution there, after the request's controls,
temperature and top-k / top-p / min-p); the first rejected position gets a token drawn from
normalize(max(0, p_j - q_j)) and ends the row; when every proposal is accepted, the target's own draw at
the next position (the plain sampler's, with the plain run's key) is the bonus token. Each output
position then follows the target's distribution exactly, whatever q is.

Randomness comes from the request's own seed: position j's keys are derived from the plain sampler's key
for that token, `fold_in(key(seed), g + j)` (g: the index of the token generated next), folded with
ACCEPT (the uniform of the acceptance test) and RESIDUAL (the Gumbel noise of the draw on rejection).
A draft that samples d_j with the plain key itself (draft.py does) draws independently of both, so a
seeded request is reproducible, and each position's randomness is fresh whatever happened before it.
Greedy rows accept the longest prefix where the proposals equal the target's argmaxes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACCEPT, RESIDUAL = 1, 2  # fold_in salts of the per-position key


def accept_rule(p_d, q_d, u):
    """Whether each proposal is accepted: u < p(d) / q(d), written without the division (q(d) > 0 for
    a token drawn from q). All f32[R, K]; returns bool[R, K]."""
    return u * q_d < p_d


def _keys(seed, gen, salt):
    """Keys u32[R, K] x key of position gen[r] + j for seeds u32[R], gen i32[R, K], folded with `salt`."""
    one = lambda s, g: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), g), salt)  # noqa: E731
    return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(seed, gen)


def rejection_sample(p, q, drafts, num_drafts, target_tokens, seed, gen_index, greedy):
    """The tokens each row outputs: accepted proposals, then one corrected or bonus token.

    p f32[R, K+1, V]: the target's distributions at each position (rows past a row's proposals unused
    but for the bonus at position num_drafts); q f32[R, K, V]: the proposer's; drafts i32[R, K];
    num_drafts i32[R]; target_tokens i32[R, K+1]: the plain sampler's draws (greedy rows: argmaxes);
    seed u32[R]; gen_index i32[R] (the index of the token generated at position 0); greedy bool[R].
    Returns tokens i32[R, K+1], -1 past each row's a + 1 tokens (a: proposals accepted)."""
    R, K1, V = p.shape
    K = K1 - 1
    j = jnp.arange(K1)[None, :]                                           # [1, K+1]
    gen = gen_index[:, None] + j[:, :K]                                   # [R, K]
    p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]  # [R, K]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]      # [R, K]
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(_keys(seed, gen, ACCEPT))  # [R, K]
    live = j[:, :K] < num_drafts[:, None]                                 # [R, K]
    sampled_ok = accept_rule(p_d, q_d, u)
    greedy_ok = target_tokens[:, :K] == drafts
    ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok) & live
    a = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)            # [R] accepted

    # the draw on rejection: normalize(max(0, p - q)) by Gumbel-max (p itself where p = q to rounding)
    resid = jnp.maximum(p[:, :K] - q, 0.0)                                 # [R, K, V]
    resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p[:, :K])
    noise = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (V,))))(_keys(seed, gen, RESIDUAL))
    corrected = jnp.argmax(jnp.log(resid) + noise, axis=-1).astype(jnp.int32)  # [R, K]
    at = jnp.minimum(a, K)[:, None]                                       # [R, 1]
    rejected = jnp.take_along_axis(jnp.concatenate([corrected, corrected[:, :1]], 1), at, axis=1)[:, 0]
    bonus = jnp.take_along_axis(target_tokens, a[:, None], axis=1)[:, 0]
    last = jnp.where(greedy | (a >= num_drafts), bonus, rejected)         # [R]
    padded = jnp.concatenate([drafts, jnp.zeros((R, 1), drafts.dtype)], axis=1)  # [R, K+1]
    return jnp.where(j < a[:, None], padded, jnp.where(j == a[:, None], last[:, None], -1)).astype(jnp.int32)
