"""Host half of the per-position sampler inputs of a speculative step (numpy; the device half is
positions.py): what changes along the proposals d_1 .. d_m of a request.

- the grammar mask: the request's matcher consumes the proposals one by one, the mask after d_1 .. d_j is
  position j's, and the matcher is rolled back by as many tokens (the accepted ones are consumed again,
  lazily, like any output token). Proposals from the first one the grammar refuses are not consumed:
  position j - 1 masks that d_j, so the verifier rejects it and the positions past it are never used;
- allowed_token_ids: the same row at every position (ANDed with the grammar's);
- logit_bias + bad_words: the bans of bad words after the output tokens and d_1 .. d_j;
- penalties: the proposals written into the slot's token history after its tokens (the next step's
  history sync overwrites them with the tokens kept).

Arrays: spec_bitmask i32[S, K, W], spec_bias_ids i32[S, K, NB], spec_bias_values f32[S, K, NB]; row j - 1
is position j. With no speculating slot that uses a control, constant arrays (`none`, placed on the
device once by spec_decode/step.py's Verification) go to the step instead.
"""
from __future__ import annotations

import numpy as np

from jaxpaged.core.logit_controls import NUM_BIAS, banned_by_bad_words


class PositionControls:
    def __init__(self, max_num_seqs: int, num_spec: int, words: int):
        S, K = max_num_seqs, num_spec
        self.bitmask = np.full((S, K, words), -1, np.int32)        # [S, K, W]
        self.bias_ids = np.full((S, K, NUM_BIAS), -1, np.int32)    # [S, K, NB]
        self.bias_values = np.zeros((S, K, NUM_BIAS), np.float32)  # [S, K, NB]
        self._dirty_mask: list[int] = []
        self._dirty_bias: list[int] = []
        self.none = dict(spec_bitmask=self.bitmask.copy(), spec_bias_ids=self.bias_ids.copy(),
                         spec_bias_values=self.bias_values.copy())  # placed on the device by Verification

    def arrays(self, scheduled, structured, biased, pbatch) -> dict:
        """The step's spec_* arrays for (request, tokens) pairs; `structured`: core.structured's
        StructuredOutputs, `biased`: the requests using logit_bias / bad_words, `pbatch`: the persistent
        batch (its history rows get the proposals of slots with penalties)."""
        spec = [req for req, _ in scheduled if req.spec_token_ids]
        for req in spec:
            if pbatch.penalties[req.slot]:
                L = len(req.token_ids)
                pbatch.history[req.slot, L:L + len(req.spec_token_ids)] = req.spec_token_ids
        masked = [r for r in spec if r.params.structured_outputs is not None or r.params.allowed_token_ids is not None]
        bias = [r for r in spec if r in biased]
        out = dict(self.none)
        if masked or self._dirty_mask:
            self.bitmask[self._dirty_mask] = -1
            self._dirty_mask = [r.slot for r in masked]
            for req in masked:
                self._fill_masks(req, structured)
            # copies: the step may still read these (CPU inputs can alias host memory) when the next are filled
            out["spec_bitmask"] = self.bitmask.copy()
        if bias or self._dirty_bias:
            self.bias_ids[self._dirty_bias], self.bias_values[self._dirty_bias] = -1, 0
            self._dirty_bias = [r.slot for r in bias]
            for req in bias:
                self._fill_bias(req)
            out.update(spec_bias_ids=self.bias_ids.copy(), spec_bias_values=self.bias_values.copy())
        return out

    def _fill_masks(self, req, structured) -> None:
        d, s, K = req.spec_token_ids, req.slot, self.bitmask.shape[1]
        if req.params.structured_outputs is not None:
            import llguidance.numpy as lln
            m = structured.matcher(req)
            ok = m.validate_tokens(d)                  # proposals the grammar takes, from the first
            rows = self.bitmask.reshape(-1, self.bitmask.shape[2])  # [S*K, W] view
            for j in range(ok):
                m.consume_token(d[j])
                lln.fill_next_token_bitmask(m, rows, s * K + j)
            if ok:
                m.rollback(ok)
        if req.params.allowed_token_ids is not None:
            self.bitmask[s, :len(d)] &= structured.allowed(req)

    def _fill_bias(self, req) -> None:
        d, s = req.spec_token_ids, req.slot
        bias = req.params.logit_bias or {}
        output = req.output_token_ids
        for j in range(1, len(d) + 1):
            ban = banned_by_bad_words(req.bad_words_token_ids, output + d[:j]) if req.bad_words_token_ids else []
            ids = list(bias) + ban
            self.bias_ids[s, j - 1, :len(ids)] = ids
            self.bias_values[s, j - 1, :len(ids)] = list(bias.values()) + [-np.inf] * len(ban)
