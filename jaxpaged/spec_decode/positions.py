"""Device half of the per-position sampler inputs of a speculative step (inside the compiled step).

At proposed position j (0 = the row of the request's last token) the plain sampler must see what a plain
run would show it after d_1 .. d_j had been appended: its key and `gen_index` + j, the `min_tokens` bans
while gen_index + j is below min_tokens, a token history of history_len + j tokens (the host wrote the
proposals after the request's tokens: penalties count them), and for j >= 1 the grammar / allowed-token
bitmask and the logit_bias + bad-word bans the host computed after d_1 .. d_j (`spec_bitmask`,
`spec_bias_ids`, `spec_bias_values`, [S, K, ...], row j - 1; spec_decode/controls.py).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxpaged.step.sampler import slot_rows

PER_POSITION = ("bitmask", "bias_ids", "bias_values")  # slot arrays replaced by spec_<name>[:, j - 1] at j >= 1


def proposal_rows(last, num_drafts, num_positions: int):
    """i32[R, K+1]: the step's row of each position of R slots; last i32[R] (each slot's last row, that of
    its last proposal), num_drafts i32[R] (m); positions past m repeat the last row."""
    j = jnp.arange(num_positions)[None, :]                                   # [1, K+1]
    return last[:, None] - num_drafts[:, None] + jnp.minimum(j, num_drafts[:, None])


def position_rows(sp: dict, batch: dict, at, num_spec: int) -> dict:
    """The sampler's inputs for R * (K+1) rows: slot `at[r]` (i32[R]) at position j is row r * (K+1) + j.

    sp: the step's sampling dict (per-slot arrays [S, ...], flags, and spec_<name> [S, K, ...]);
    batch: min_tokens i32[S]."""
    S, K1 = batch["logits_indices"].shape[0], num_spec + 1
    R = at.shape[0]
    flat_at = jnp.repeat(at, K1)                                             # [R*(K+1)]
    j = jnp.tile(jnp.arange(K1), R)                                          # [R*(K+1)]
    prow = slot_rows({k: v for k, v in sp.items() if not k.startswith("spec_")}, flat_at, S)
    gen = prow["gen_index"] + j                                              # each position's own key and index
    below = gen < batch["min_tokens"][flat_at]                               # min_tokens, position by position
    prow.update(gen_index=gen, banned=jnp.where(below[:, None], prow["banned"], -1),
                history_len=prow["history_len"] + j)                         # d_1 .. d_j in the history
    later, prev = (j > 0)[:, None], jnp.maximum(j - 1, 0)
    for name in PER_POSITION:
        prow[name] = jnp.where(later, sp[f"spec_{name}"][flat_at, prev], prow[name])  # [R*(K+1), ...]
    return prow

