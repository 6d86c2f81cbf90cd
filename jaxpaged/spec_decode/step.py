"""Speculative decoding in the runner: the verifying step's draw (step/features.py `Sampling`), its inputs
(the proposals, the per-position controls) and its tokens read back. A speculative engine's step in which
no request proposes is the plain `Sampling`, read back in the same form (`Sampled`, one token a slot).

The runner compiles the verifying variant beside the plain one (runner.variants) and runs it when some
scheduled request proposes; then a slot's result is Sampled(its new tokens: accepted proposals, then the
target's next token; their logprob dicts or None).
"""
from __future__ import annotations

import numpy as np

from jaxpaged.core.step_result import Sampled
from jaxpaged.spec_decode.controls import PositionControls
from jaxpaged.spec_decode.positions import proposal_rows
from jaxpaged.spec_decode.verify import verify_rows
from jaxpaged.step.features import Sampling


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


class Verification(Sampling):
    """The verifying step: each slot's proposals verified by the target (verify.py), K + 1 positions.

    structured: core.structured's StructuredOutputs; controls: core.logit_controls' LogitControls (its
    requests use logit_bias / bad_words); pbatch: the persistent batch (penalties see the proposals);
    draft_model: the proposer hands its distributions q (draft_probs) with the schedule; place: host
    array -> device array (the constant inputs stay there)."""

    def __init__(self, num_logprobs: int, logprobs_mode: str, num_spec: int, structured, controls, pbatch,
                 vocab_size: int, draft_model: bool, place):
        super().__init__(num_logprobs, logprobs_mode)
        S = pbatch.max_num_seqs
        self.num_spec, self.structured, self.controls, self.pbatch = num_spec, structured, controls, pbatch
        self.no_draft_probs = place(np.zeros((S, num_spec, vocab_size), np.float32)) if draft_model else None
        self.positions = PositionControls(S, num_spec, structured.words)  # masks, bans, history per position
        self.positions.none = self.placeholders = {k: place(v) for k, v in self.positions.none.items()}

    def inputs(self, out, slots, T, batch, sp):
        """draft_tokens, num_drafts, min_tokens (and draft_probs), the spec_* per-position controls."""
        q = out.draft_probs if out.draft_probs is not None else self.no_draft_probs  # [S, K, V] or None
        batch.update(draft_inputs(out.scheduled, self.pbatch.max_num_seqs, self.num_spec, q))
        sp.update(self.positions.arrays(out.scheduled, self.structured, self.controls.requests, self.pbatch))

    def draw(self, logits_of, h, batch, sp) -> tuple:
        """tokens i32[R, K+1] (-1 past each row's output), logprob f32[R, K+1], top [R, K+1, NL] x2."""
        return verify_rows(logits_of, h, batch, sp, self.num_spec, self.num_logprobs, self.logprobs_mode)

    def token_rows(self, batch):
        """i32[S, K+1]: the row whose logits gave each slot's j-th new token (positions.proposal_rows)."""
        return proposal_rows(batch["logits_indices"], batch["num_drafts"], self.num_spec + 1)

    def read_tokens(self, step) -> dict[int, Sampled]:
        """slot -> Sampled(its new tokens, their logprobs or None) of a launched verifying step
        (runner.Launched; tokens i32[S, K+1], -1 past each slot's output)."""
        tokens = np.asarray(step.tokens)
        counts = (tokens >= 0).sum(axis=1)                                  # [S]
        result = {s: Sampled(tokens[s, :counts[s]].tolist(), None) for s in step.slots}
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
            result[s] = Sampled(toks, lps)
        return result
