"""Pooling, the runner feature (step/features.py): the pooled final-norm hidden states of the prompts of
requests that ask (`SamplingParams.pooling`, core/pooling.py), read back after the step that computed them.

In the step, per slot, over the rows of its chunk of this step (f32[S, D] each): the last row's state (the
row whose logits give its token), the sum of its rows' states, and its first row's. On the host each
scheduled pooling request still in its prompt keeps what its type needs (`Pooling.type`, the engine's
`pooler_config` by default): MEAN adds its chunks' sums (a chunk at position 0 starts anew: a preempted
request recomputes its prompt), CLS takes the chunk at position 0, LAST the chunk that ends the prompt; when
the prompt is complete the vector is finished (mean, normalization) on the request. MEAN and CLS requests
bypass prefix-cache hits (`Request.needs_every_position`); LAST needs only the last position, which a hit
never skips.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.step.features import StepFeature


class Pooler(StepFeature):
    """Pooled final-norm states for the requests that ask, by each one's pooling type."""

    def inputs(self, out, slots, T, batch, sp):
        """The read-back plan: (request, slot, first position of its chunk, chunk length) of each scheduled
        request that pools and is still in its prompt."""
        return [(req, req.slot, req.num_computed_tokens, n) for req, n in out.scheduled
                if req.params.pooling is not None and req.num_computed_tokens < req.num_prompt_tokens]

    def outputs(self, traced) -> tuple:
        """(f32[S, D] x 3): per slot, its chunk's last row's final-norm state, the sum of its rows', its first
        row's (LAST, MEAN, CLS)."""
        h, batch = traced.h.astype(jnp.float32), traced.batch  # h [T, D]
        qsl = batch["query_start_loc"]  # [S + 1]
        S, T = qsl.shape[0] - 1, h.shape[0]
        slot = jnp.searchsorted(qsl, jnp.arange(T), side="right") - 1  # [T]; padding rows -> S (dropped)
        return (h[batch["logits_indices"]], jax.ops.segment_sum(h, slot, num_segments=S),
                h[jnp.minimum(qsl[:S], T - 1)])

    def read(self, plan, outputs, step) -> None:
        """Keep each request's part; finish its vector once its prompt is complete."""
        last, sums, first = (np.asarray(a) for a in outputs)  # [S, D] each
        for req, s, start, n in plan:
            if req.is_finished:  # finished meanwhile (async)
                continue
            kind = req.params.pooling.type
            if kind == "MEAN":
                req.pooled = sums[s].copy() if start == 0 else req.pooled + sums[s]
            elif kind == "CLS" and start == 0:
                req.pooled = first[s].copy()
            if start + n >= req.num_prompt_tokens:
                done = last[s].copy() if kind == "LAST" else req.pooled
                req.pooled = req.params.pooling.finish(done, req.num_prompt_tokens)
