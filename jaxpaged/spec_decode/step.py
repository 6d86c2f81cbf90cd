"""Host glue of a speculative step: the proposals as step inputs, and the verified tokens read back."""
from __future__ import annotations

import numpy as np

from jaxpaged.step.research import read_hidden


def draft_inputs(scheduled, num_slots: int, num_spec: int, draft_probs=None) -> dict:
    """The step's proposal arrays for `scheduled` [(request, tokens)]: draft_tokens i32[S, K] (-1: none),
    num_drafts i32[S], min_tokens i32[S] (bans at each proposed position follow it; verify.py), and
    the proposer's distributions draft_probs f32[S, K, V] (a device array) when it has them."""
    draft_tokens = np.full((num_slots, num_spec), -1, np.int32)
    num_drafts = np.zeros(num_slots, np.int32)
    min_tokens = np.zeros(num_slots, np.int32)
    for req, _ in scheduled:
        d = req.spec_token_ids
        if d:
            draft_tokens[req.slot, :len(d)] = d
            num_drafts[req.slot] = len(d)
        min_tokens[req.slot] = req.params.min_tokens
    out = dict(draft_tokens=draft_tokens, num_drafts=num_drafts, min_tokens=min_tokens)
    return out if draft_probs is None else dict(out, draft_probs=draft_probs)


def read_verified(step) -> dict[int, tuple[list[int], list | None]]:
    """A launched speculative step (runner.Launched; tokens i32[S, K+1], -1 past each slot's output) ->
    slot -> (its new tokens: accepted proposals then the target's next token, their logprobs or None)."""
    tokens = np.asarray(step.tokens)
    counts = (tokens >= 0).sum(axis=1)                                  # [S]
    result = {s: (tokens[s, :counts[s]].tolist(), None) for s in step.slots}
    if step.hidden_plan:
        _read_hidden(step.hidden_plan, step.hidden, counts)
    if not step.any_logprobs:
        return result
    tok_lp, top_lp, top_ids = (np.asarray(a) for a in step.logprobs)     # [S, K+1], [S, K+1, NL] x2
    for (req, _), s in zip(step.out.scheduled, step.slots):
        k = req.params.logprobs
        if k is None:
            continue
        toks, lps = result[s][0], []
        for j, t in enumerate(toks):
            lp = {int(i): float(v) for i, v in zip(top_ids[s, j, :k], top_lp[s, j, :k])}
            lp[t] = float(tok_lp[s, j])
            lps.append(lp)
        result[s] = (toks, lps)
    return result


def _read_hidden(plan, hidden, counts) -> None:
    """Store the states of a verified step on the requests that asked: the prompt's as in a plain step,
    and one per new token (accepted proposals and the target's next token; hidden[0] f32[S, K+1, nL, D])."""
    rows = np.asarray(hidden[0])                                        # [S, K+1, nL, D]
    read_hidden([(req, s, None, row, pos, m) for req, s, _, row, pos, m in plan], (rows[:, 0], hidden[1]))
    for req, s, token, *_ in plan:
        if token is not None:
            for j in range(counts[s]):
                req.hidden_states[token + j] = rows[s, j]
