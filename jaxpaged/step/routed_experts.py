"""Routed experts for routing replay (`SamplingParams.return_routed_experts`, mixture-of-experts models):
the expert ids each layer's router chose for each token, so a trainer's forward pass can reuse them.

The step of a MoE model returns them for every token row, i32[T, L, k]: the decoder's layer scan gives
each layer's ids (computed anyway, to route) as its per-layer outputs, so no step variant and no extra
compilation. They leave the device only after a step that scheduled a request asking for them: `plan`
(at launch) names that step's rows of each such request, `collect` (at read) copies them to the host.

A request keeps them in a buffer indexed by position (`Request.routed_experts`, i32[capacity, L, k]):
a token's ids are written at its position, so a chunk recomputed after preemption replaces the old ones,
never adds a second copy. A request whose ids are missing at a position a prefix-cache hit would skip
bypasses the cache (`Request.needs_routes`, read by `Scheduler.schedule`). The last sampled token has no
ids (it is never fed through the model), as in vLLM: RequestOutput.prompt_routed_experts i32[P, L, k]
(sample 0's; the other samples of n > 1 share its prompt blocks and skip it) and
CompletionOutput.routed_experts i32[G - 1, L, k], in the final output.
"""
from __future__ import annotations

import weakref

import numpy as np

from jaxpaged.core.validation import InvalidParam
from jaxpaged.step.features import StepFeature


def check_params(params, model_cfg) -> None:
    """Refuse return_routed_experts on a model without experts (InvalidParam names the field)."""
    if params.return_routed_experts and not model_cfg.num_experts:
        raise InvalidParam("return_routed_experts", "return_routed_experts needs a mixture-of-experts model "
                                                    "(Mixtral, Qwen3-MoE, OLMoE); this model has no experts",
                           code="routed_experts_unsupported")


def plan(scheduled, asking) -> list[tuple]:
    """[(request, first row, first position, rows)] of a step's (request, tokens) for the requests that
    ask; `asking`: those that asked (a step with none of them costs one check)."""
    out, row = [], 0
    for req, n in scheduled if asking else ():
        if req.params.return_routed_experts:
            out.append((req, row, req.num_computed_tokens, n))
        row += n
    return out


def collect(wants: list[tuple], routes) -> None:
    """Write a read-back step's ids (`routes`: the device array i32[T, L, k]) into the requests' buffers."""
    wants = [w for w in wants if not w[0].is_finished]  # finished meanwhile (async): its output is built
    if not wants:
        return
    ids = np.asarray(routes)  # [T, L, k]
    for req, row, pos, n in wants:
        buf = req.routed_experts
        if buf is None or len(buf) < pos + n:
            grown = np.zeros((max(pos + n, 2 * len(buf) if buf is not None else 0), *ids.shape[1:]), np.int32)
            if buf is not None:
                grown[:len(buf)] = buf
            req.routed_experts = buf = grown
        buf[pos:pos + n] = ids[row:row + n]
        req.num_routed = pos + n


class RoutedExperts(StepFeature):
    """The runner's feature (step/features.py) on a MoE model: the decoder returns the ids (`routes`), read
    back after a step that scheduled a request asking (those `track` noted)."""

    def __init__(self):
        self.requests: weakref.WeakSet = weakref.WeakSet()  # requests that asked

    def track(self, req) -> None:
        if req.params.return_routed_experts:
            self.requests.add(req)

    def inputs(self, out, slots, T, batch, sp):
        return plan(out.scheduled, self.requests)

    def decoder_args(self, batch, sp) -> dict:
        return dict(routes=True)

    def outputs(self, traced) -> tuple:
        return (traced.decoded["routes"],)  # i32[T, L, k]

    def read(self, plan, outputs, step) -> None:
        collect(plan, outputs[0])
