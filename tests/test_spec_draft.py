"""Speculative decoding with a draft model (jaxpaged/spec_decode/draft.py, rejection.py): general rejection
sampling keeps the target distribution (chi-square, with wrong acceptance rules that fail it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.spec_decode import rejection
from jaxpaged.spec_decode.rejection import rejection_sample

CRITICAL = {5: 20.52, 6: 22.46, 7: 24.32}  # chi-square, df -> 99.9th percentile


def _chi2(counts, probs):
    """Pearson's statistic of observed counts against expected probabilities (cells with mass only)."""
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum():                                           # tokens the target never draws
        return float("inf"), int(keep.sum()) - 1
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), int(keep.sum()) - 1


def _normalize(x):
    x = np.asarray(x, np.float32)
    return x / x.sum(-1, keepdims=True)


P = _normalize([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0, 0], [0.05, 0.1, 0.5, 0.2, 0.1, 0.05, 0, 0],
                [0.3, 0.3, 0.1, 0.1, 0.1, 0.1, 0, 0]])                 # [K+1, V] the target's, per position
Q = _normalize([[0.1, 0.3, 0.1, 0.3, 0.0, 0.05, 0.15, 0], [0.3, 0.1, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05]])  # [K, V]


def _draws(p, q, R, greedy=False):
    """R rows (seeds 0..R-1): proposals drawn from q with the plain sampler's key per position (as the draft
    does), the target's plain draws from p, then rejection sampling. Returns (tokens [R, K+1], drafts)."""
    K1, V = p.shape
    seed, gen = jnp.arange(R, dtype=jnp.uint32), jnp.full(R, 5, jnp.int32)

    def draw(dist, s, j):  # Gumbel-max with the plain key fold_in(key(seed), gen + j)
        key = jax.random.fold_in(jax.random.key(s), 5 + j)
        return jnp.argmax(jnp.log(dist) + jax.random.gumbel(key, (V,)))

    @jax.jit
    def run():
        rows = jnp.arange(K1)
        drafts = jax.vmap(lambda s: jax.vmap(lambda d, j: draw(d, s, j))(jnp.asarray(q), rows[:-1]))(seed)
        target = jax.vmap(lambda s: jax.vmap(lambda d, j: draw(d, s, j))(jnp.asarray(p), rows))(seed)
        if greedy:
            target = jnp.broadcast_to(jnp.argmax(jnp.asarray(p), -1), (R, K1))
        tok = rejection_sample(jnp.broadcast_to(jnp.asarray(p), (R, K1, V)), jnp.broadcast_to(jnp.asarray(q), (R,) + q.shape),
                               drafts.astype(jnp.int32), jnp.full(R, K1 - 1, jnp.int32), target.astype(jnp.int32),
                               seed, gen, jnp.full(R, greedy))
        return tok, drafts
    return tuple(np.asarray(a) for a in run())


def _position_stats(tokens, p):
    """Chi-square statistics of position 0 against p[0] and of position 1 (rows that accepted d_0) against p[1]."""
    out = []
    for j in range(2):
        rows = tokens[:, j] >= 0                                      # position 1: d_0 was accepted
        assert rows.sum() > 1000
        out.append(_chi2(np.bincount(tokens[rows, j], minlength=p.shape[1]), p[j]))
    return out


def test_rejection_sampling_keeps_the_target_distribution():
    tokens, _ = _draws(P, Q, 8000)
    for stat, df in _position_stats(tokens, P):
        assert stat < CRITICAL[df]
    assert ((tokens >= 0).sum(1) >= 1).all() and ((tokens >= 0).sum(1) == 3).any()  # partial and full runs


@pytest.mark.parametrize("rule", [lambda p_d, q_d, u: jnp.ones_like(u, bool), lambda p_d, q_d, u: u < p_d],
                         ids=["always-accept", "accept-with-p"])
def test_wrong_acceptance_rules_fail(monkeypatch, rule):
    monkeypatch.setattr(rejection, "accept_rule", rule)
    tokens, _ = _draws(P, Q, 8000)
    stat, df = _position_stats(tokens, P)[0]
    assert stat > CRITICAL[df]


def test_proposals_from_the_target_itself_are_all_accepted_and_greedy_takes_the_argmax_prefix():
    tokens, drafts = _draws(P, P[:2], 500)
    assert (tokens[:, :2] == drafts).all() and (tokens[:, 2] >= 0).all()
    tokens, drafts = _draws(P, Q, 300, greedy=True)
    best = P.argmax(-1)                                                # [0, 2, 0]
    for t, d in zip(tokens, drafts):
        a = int(d[0] == best[0]) * (1 + int(d[1] == best[1]))
        assert t.tolist() == list(d[:a]) + [best[a]] + [-1] * (2 - a)
