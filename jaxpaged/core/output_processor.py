"""The output processor: stop checks, detokenizing and the outputs of each user request.

A user request is a `Group` of its n samples (one `Request` each). After every step the engine hands
the processor the requests that got tokens; it checks each token they got since its last look for a
stop (EOS and stop ids, stop strings, a complete grammar, max_tokens, max_model_len), finishes the
stopped samples in the scheduler, and builds the outputs of the groups that advanced (streamed ones)
or finished. A step that gave a request several tokens (accepted speculative proposals) is checked
token by token, as if each came in its own step: tokens past the first stop are dropped.

Host code: numpy at most (the final outputs' hidden states and routed experts are host arrays).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.core.outputs import CompletionOutput, RequestOutput
from jaxpaged.core.request import ListPrefix, Request, RequestStatus
from jaxpaged.core.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class Group:
    """One user request: its n samples and their detokenizers."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival: float
    stream: bool = True                # an output every step it advances (else only the final one)
    finished_time: float | None = None
    # seconds between one step's tokens and the next's, over its samples (vLLM's inter-token latencies)
    inter_token_latencies: list[float] = field(default_factory=list)

    def __post_init__(self):
        # detokenize every step (streamed text, stop strings), or only when the final output is built
        self.text_each_step = self.stream or bool(self.samples[0].params.stop)


class OutputProcessor:
    """The unfinished groups, by request id, and what happens to them after each step."""

    def __init__(self, scheduler, structured, max_model_len: int):
        self.scheduler, self.structured, self.max_model_len = scheduler, structured, max_model_len
        self.groups: dict[str, Group] = {}
        self._ready: list[RequestOutput] = []  # outputs built since the last `update` returned

    def add(self, group: Group) -> None:
        self.groups[group.request_id] = group

    def abort(self, request_id: str) -> Group | None:
        """Finish the group's samples now ("abort") and forget it; None for an unknown id."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            for req in group.samples:
                self.scheduler.abort(req)
        return group

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished group; their final outputs."""
        return [self._finish(self.abort(rid), time.monotonic()) for rid in list(self.groups)]

    def fail(self, group_ids, message: str) -> None:
        """A failed step's groups: every sample finishes with "error"; their final outputs, which carry
        `message`, come with the next `update`."""
        groups, now = [self.groups[g] for g in group_ids], time.monotonic()
        for group in groups:
            for req in group.samples:
                self.scheduler.finish(req, "error")
        self._ready += [self._finish(self.groups.pop(group.request_id), now, message) for group in groups]

    # -- after a step ---------------------------------------------------------------------------------
    def update(self, got: list[Request]) -> list[RequestOutput]:
        """`process(got)`, then every output built since the last update (a failed step's, those of a step
        the async executor read back early), in the order they were built."""
        self.process(got)
        outputs, self._ready = self._ready, []
        return outputs

    def process(self, got: list[Request]) -> None:
        """Stop checks of the requests that got tokens, then the outputs of the groups that changed.

        Only requests that stream or have stop strings are detokenized here; the others when their final
        output is built."""
        now, groups, outputs = time.monotonic(), self.groups, self._ready
        touched: dict[str, Group] = {}  # groups of n > 1 samples: one output for all that advanced
        for req in got:
            group = groups[req.group_id]
            if req.first_token_time is None:
                req.first_token_time = now
            else:
                group.inter_token_latencies.append(now - req.last_token_time)
            req.last_token_time = now
            if len(req.token_ids) - req.num_checked_tokens > 1:
                reason = self._check_each(req, group)
            else:
                stop_string = group.text_each_step and group.detoks[req.index].catch_up(req.token_ids)
                reason = self._check_stop(req, stop_string)
            req.num_checked_tokens = len(req.token_ids)
            if reason:
                self.scheduler.finish(req, reason)
            if len(group.samples) == 1:  # the usual case: its output now, no second pass
                if reason:
                    outputs.append(self._finish(groups.pop(group.request_id), now))
                elif group.stream:
                    outputs.append(self.output(group, False))
            elif reason or group.stream:
                touched[req.group_id] = group
        for group in touched.values():
            if all([r.status is RequestStatus.FINISHED for r in group.samples]):
                outputs.append(self._finish(groups.pop(group.request_id), now))
            elif group.stream:
                outputs.append(self.output(group, False))

    def _check_stop(self, req: Request, stop_string: bool) -> str | None:
        """The finish reason after the request's last token, or None."""
        p, tok, length = req.params, req.token_ids[-1], len(req.token_ids)
        num_output = length - len(req.prompt_token_ids)
        if (tok in req.stop_ids or stop_string) and num_output >= p.min_tokens:
            return "stop"
        if p.structured_outputs is not None and self.structured.is_complete(req):  # no further token allowed
            return "stop"
        if num_output >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _check_each(self, req: Request, group: Group) -> str | None:
        """Stop checks after each token the request got since the last check, as if they came one step
        each; the tokens (and logprobs) past the first stop are dropped (an accepted run never overshoots)."""
        num_new = len(req.token_ids) - req.num_checked_tokens
        tail, req.token_ids[-num_new:] = req.token_ids[-num_new:], []
        lps = None
        if req.logprobs is not None:
            lps, req.logprobs[-num_new:] = req.logprobs[-num_new:], []
        for j, tok in enumerate(tail):
            req.token_ids.append(tok)
            if lps is not None:
                req.logprobs.append(lps[j])
            reason = self._check_stop(req, group.text_each_step and group.detoks[req.index].catch_up(req.token_ids))
            if reason:
                return reason
        return None

    # -- outputs --------------------------------------------------------------------------------------
    def _finish(self, group: Group, now: float, error: str | None = None) -> RequestOutput:
        """The final output of a group already taken out of `groups`."""
        group.finished_time = now
        return self.output(group, True, error)

    def output(self, group: Group, finished: bool, error: str | None = None) -> RequestOutput:
        """The group's cumulative output (the text of one detokenized only now caught up first)."""
        samples, detoks = group.samples, group.detoks
        if not group.text_each_step:
            for r, d in zip(samples, detoks):
                d.catch_up(r.token_ids)
        final = finished and error is None
        outs = [_completion(r, d, final) for r, d in zip(samples, detoks)]
        r = samples[0]
        if len(samples) == 1:
            first = r.first_token_time
        else:
            first = min([r.first_token_time for r in samples if r.first_token_time is not None], default=None)
        plp = r.prompt_logprobs
        scheduled = min([r.scheduled_time for r in samples if r.scheduled_time is not None], default=None)
        last = max([r.last_token_time for r in samples if r.last_token_time is not None], default=None)
        metrics = dict(arrival_time=group.arrival, scheduled_time=scheduled, first_token_time=first,
                       last_token_time=last, finished_time=group.finished_time,
                       inter_token_latencies=group.inter_token_latencies)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                             r.num_cached_tokens, metrics,
                             error, r.prompt_hidden_states if finished else None,
                             prompt_logprobs=list(plp) if plp is not None else None,
                             prompt_routed_experts=_prompt_routes(r) if final else None)


def _completion(r: Request, detok: IncrementalDetokenizer, final: bool) -> CompletionOutput:
    """One sample's part of its group's output; its token ids and logprobs are copied only when read.
    final (finished without error): with its hidden states and routed experts, when asked."""
    return CompletionOutput(r.index, detok.visible_text(r.status is RequestStatus.FINISHED),
                            ListPrefix(r.token_ids, len(r.prompt_token_ids), len(r.token_ids)),
                            ListPrefix(r.logprobs, 0, len(r.logprobs)) if r.logprobs is not None else None,
                            r.finish_reason, _completion_hidden(r) if final else None,
                            _completion_routes(r) if final else None)


def _completion_hidden(req: Request) -> np.ndarray | None:
    """The generated tokens' states, f32[num_generated, nL, D] (None unless it asked)."""
    if not req.params.return_hidden_states:
        return None
    return np.stack([req.hidden_states[i] for i in range(req.num_prompt_tokens, len(req.token_ids))])


def _prompt_routes(req: Request) -> np.ndarray | None:
    """Sample 0's prompt tokens' routed expert ids, i32[P, L, k] (None unless it asked)."""
    if not req.params.return_routed_experts or req.routed_experts is None:
        return None
    return req.routed_experts[:req.num_prompt_tokens].copy()


def _completion_routes(req: Request) -> np.ndarray | None:
    """The generated tokens' routed expert ids but the last's, i32[G - 1, L, k] (None unless it asked)."""
    if not req.params.return_routed_experts or req.routed_experts is None:
        return None
    end = max(min(req.num_routed, len(req.token_ids) - 1), req.num_prompt_tokens)
    return req.routed_experts[req.num_prompt_tokens:end].copy()
