"""The logprobs of chosen token ids (`SamplingParams.logprob_token_ids`, vLLM's) at every generated position.

On the host, `inputs` writes each scheduled slot's ids into `logprob_token_ids i32[S, W]` (-1: none; W =
MAX_LOGPROB_TOKEN_IDS, vLLM's 128; a step where no scheduled request asks passes a placeholder already on the
device instead) and sets `any_logprob_token_ids`. On the device, only under that flag (`lax.cond`), the logits
of every row a slot's token of this step is drawn from (`Traced.rows`, [S, N]: one row, or 1 + K when
speculative decoding verifies K proposals) are computed again, log_softmax'd (logprobs_mode raw_logprobs;
raw_logits keeps the logits) and gathered at the ids: f32[S, N, W]. A step where no scheduled request asks
computes nothing and reads nothing back.

`read` gives, per slot that asked, one {token id: logprob} per row; the runner adds them to the sampled
tokens' logprob dicts after the sampled token's own entry (`logprobs` is 0 for such a request), so each
generated token carries its own logprob, then the ids' in the order asked. The processed logprobs modes
are refused at admission: these come from the raw logits.
"""
from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.sampling_params import MAX_LOGPROB_TOKEN_IDS
from jaxpaged.step.features import StepFeature


def step_token_logprobs(logits_fn, h, rows, ids, flag, logits_only: bool):
    """h [T, D] final hidden states, rows i32[S, N] (the row of each slot's n-th token), ids i32[S, W]
    (-1: none), flag bool[] -> f32[S, N, W]: the log_softmax (or, `logits_only`, the logits) of each row at
    the slot's ids; zeros when flag is off. logits_fn: hidden [M, D] -> logits [M, V], as the sampler's."""
    (S, N), W = rows.shape, ids.shape[1]

    def on(h):
        lp = logits_fn(h[rows.reshape(-1)]).astype(jnp.float32)  # [S*N, V]
        lp = lp if logits_only else jax.nn.log_softmax(lp, axis=-1)
        at = jnp.broadcast_to(jnp.maximum(ids, 0)[:, None, :], (S, N, W))
        return jnp.take_along_axis(lp.reshape(S, N, -1), at, axis=-1)

    def off(h):
        return jnp.zeros((S, N, W), jnp.float32)
    return jax.lax.cond(flag, on, off, h)


class TokenLogprobs(StepFeature):
    """The runner's feature (step/features.py): logprob_token_ids i32[S, W] and any_logprob_token_ids in,
    f32[S, N, W] out, read back only after a step that scheduled a request asking (those `track` noted)."""

    def __init__(self, num_slots: int, logprobs_mode: str, place):
        self.num_slots, self.logits_only = num_slots, logprobs_mode == "raw_logits"
        self.none = place(np.full((num_slots, MAX_LOGPROB_TOKEN_IDS), -1, np.int32))  # stays on the device
        self.placeholders = dict(logprob_token_ids=self.none)
        self.requests: weakref.WeakSet = weakref.WeakSet()  # requests that asked

    def track(self, req) -> None:
        if req.params.logprob_token_ids:
            self.requests.add(req)

    def inputs(self, out, slots, T, batch, sp):
        wants = [(req.params.logprob_token_ids, s) for (req, _), s in zip(out.scheduled, slots)
                 if req in self.requests] if self.requests else []
        ids = self.none
        if wants:
            ids = np.full((self.num_slots, MAX_LOGPROB_TOKEN_IDS), -1, np.int32)
            for asked, s in wants:
                ids[s, :len(asked)] = asked
        sp["logprob_token_ids"] = ids
        sp["any_logprob_token_ids"] = np.bool_(bool(wants))
        return wants

    def outputs(self, traced) -> tuple:
        return (step_token_logprobs(traced.logits_of, traced.h, traced.rows, traced.sp["logprob_token_ids"],
                                    traced.sp["any_logprob_token_ids"], self.logits_only),)

    def read(self, plan, outputs, step) -> dict[int, list[dict[int, float]]]:
        got = np.asarray(outputs[0])  # [S, N, W]
        return {s: [dict(zip(asked, row[:len(asked)].tolist())) for row in got[s]] for asked, s in plan}
