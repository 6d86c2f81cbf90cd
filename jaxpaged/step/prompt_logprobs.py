"""Prompt logprobs (`SamplingParams.prompt_logprobs`), computed in the step from the prefill chunks of the
requests that ask: no extra forward pass.

On the host, `targets` gives each scheduled token row the id of the prompt token that follows it
(`prompt_next i32[T]`, -1 where no one asks; a chunk's last row takes the next chunk's first token from
the request's prompt) and the flag `any_prompt_logprobs`. On the device, `step_prompt_logprobs` runs only
under that flag (`lax.cond`): it projects the hidden states of every row to logits, takes log_softmax, the
logprob of each row's next token and the top K. A step where no request asks computes nothing, and
its [T], [T, K] outputs are not read back.

`collect` appends one entry per prompt token to `Request.prompt_logprobs`, in order, and only the next
missing one: a chunk recomputed after preemption adds nothing twice. A request still missing some entries
bypasses the prefix cache (`Request.needs_prompt_logprobs`, `Scheduler.schedule`): its blocks are
computed, not matched, and still offered to the cache for others.
"""
from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.step.features import StepFeature


def step_prompt_logprobs(logits_fn, h, next_ids, flag, k: int):
    """h [T, D] final hidden states, next_ids i32[T] (-1: not asked), flag bool[] -> (logprob of the next
    token f32[T], top-k logprobs f32[T, k], their ids i32[T, k]); zeros when flag is off.
    logits_fn: hidden [T, D] -> logits [T, V], as the sampler's (lm_head, vocab-sharded, then replicated)."""
    T = h.shape[0]

    def on(h):
        lp = jax.nn.log_softmax(logits_fn(h), axis=-1)  # [T, V]
        tok = jnp.take_along_axis(lp, jnp.maximum(next_ids, 0)[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return tok, top_lp, top_ids.astype(jnp.int32)

    def off(h):
        return jnp.zeros(T, jnp.float32), jnp.zeros((T, k), jnp.float32), jnp.zeros((T, k), jnp.int32)
    return jax.lax.cond(flag, on, off, h)


def targets(scheduled, T: int, asking) -> tuple[np.ndarray, list[tuple]]:
    """(prompt_next i32[T], [(request, first row, first position, rows)]) for a step's (request, tokens);
    `asking`: the requests that asked for prompt logprobs (a step with none of them costs one check)."""
    next_ids = np.full(T, -1, np.int32)
    wants, row = [], 0
    for req, n in scheduled if asking else ():
        if req.needs_prompt_logprobs:
            c = req.num_computed_tokens
            m = min(c + n, req.num_prompt_tokens - 1) - c  # positions with a next prompt token
            if m > 0:
                next_ids[row:row + m] = req.prompt_token_ids[c + 1:c + 1 + m]
                wants.append((req, row, c, m))
        row += n
    return next_ids, wants


def collect(wants: list[tuple], arrays) -> None:
    """Append the step's prompt logprobs (device arrays of `step_prompt_logprobs`) to the requests."""
    if not wants:
        return
    tok_lp, top_lp, top_ids = (np.asarray(a) for a in arrays)
    for req, row, c, m in wants:
        k, out = req.params.prompt_logprobs, req.prompt_logprobs
        first = len(out) - (c + 1)  # the next missing entry is that of prompt token len(out)
        for i in range(first if first >= 0 else m, m):
            r = row + i
            d = {int(t): float(v) for t, v in zip(top_ids[r, :k], top_lp[r, :k])}
            d[req.prompt_token_ids[c + 1 + i]] = float(tok_lp[r])
            out.append(d)


class PromptLogprobs(StepFeature):
    """The runner's feature (step/features.py): prompt_next i32[T] and any_prompt_logprobs in, the [T], [T, K]
    logprobs out, read back only after a step that scheduled a request asking (those `track` noted)."""

    def __init__(self, num_logprobs: int):
        self.k = num_logprobs
        self.requests: weakref.WeakSet = weakref.WeakSet()  # requests that asked

    def track(self, req) -> None:
        if req.prompt_logprobs is not None:
            self.requests.add(req)

    def inputs(self, out, slots, T, batch, sp):
        batch["prompt_next"], wants = targets(out.scheduled, T, self.requests)  # [T]
        sp["any_prompt_logprobs"] = np.bool_(bool(wants))
        return wants

    def outputs(self, traced) -> tuple:
        return step_prompt_logprobs(traced.logits_of, traced.h, traced.batch["prompt_next"],
                                    traced.sp["any_prompt_logprobs"], self.k)

    def read(self, plan, outputs, step) -> None:
        collect(plan, outputs)
